"""Starting, supervising and stopping every process: the server's workers (`launch`,
`workers`), the tensor-parallel ranks on one node or several (`ranks`, `rendezvous`), what each
child does the same way (`child`) and how children are watched and stopped (`supervise`).

Nothing is imported here: a rank process (`python -m minisgl.runtime.ranks`) loads only what
it runs."""
