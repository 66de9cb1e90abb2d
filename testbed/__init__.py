"""Carpool's test bed, apart from the product: the local cluster (`devcluster`), the real
node (`realnode`), simulated GPU nodes (`simnodes`, `nodes`), the operator and extender run
from the checkout (`stack`), fault injection (`chaos`), the demo and the trace replay
(`simulate`). Installed by `make dev` only; the product never imports it."""
