"""The kubelet device plugin API (v1beta1): the proto, its generated stubs and the generator."""
