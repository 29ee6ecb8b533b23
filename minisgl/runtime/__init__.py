"""Starting, supervising and stopping every process: the server's workers and API processes
(`launch`, `workers`), the tensor-parallel ranks on one node or several and their rendezvous
(`ranks`), and what each child does the same way and how children are watched and stopped
(`child`).

Nothing is imported here: a rank process (`python -m minisgl.runtime.ranks`) loads only what
it runs."""
