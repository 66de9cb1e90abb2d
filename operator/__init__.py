"""The Carpool operator: kopf handlers over the pure core (carpool.core)."""
