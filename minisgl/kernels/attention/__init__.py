"""Paged attention kernels (`decode`, `extend`, `mixed`, `store`, their tile helpers in
`common`), the pure-torch references (`reference`) and random paged pools (`testing`)."""
