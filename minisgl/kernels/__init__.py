"""Device kernels (Triton) with pure-torch references beside them.

Importing this package does not import Triton: the kernel modules (`store`, `decode`,
`extend`) import it themselves, so CPU-only installs can still use `reference`.
"""
