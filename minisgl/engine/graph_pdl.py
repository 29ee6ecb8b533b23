"""Programmatic (PDL) edges into the cuBLAS GEMMs of a captured CUDA graph.

Our Triton kernels are launched with programmatic dependent launch: in a captured graph the edge
into each of them is programmatic, so it is scheduled while its predecessor still runs and waits
(`griddepcontrol.wait`) before it touches memory. The GEMMs come from cuBLAS through torch, which
launches them plainly: each edge into a GEMM is a full stop (the predecessor drains, then the GEMM
launches and ramps up). A decode step of a dense model has four such edges per layer.

`rewrite` turns those edges programmatic in a captured graph before it is instantiated. That is
only correct when the GEMM kernel itself waits on its predecessor before reading its inputs (the
CUTLASS-built Hopper kernels carry that wait; whether a given cuBLAS kernel does is a property of
the cuBLAS build). So an edge is rewritten only into a kernel whose name passed `verify`: a graph
in which a predecessor lets dependents launch at once and writes the GEMM's input late must give
the GEMM the late input.

The graph is edited through the CUDA driver API (libcuda, CUDA 12.3+ edge data) with ctypes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
from collections.abc import Callable, Iterable

import torch

logger = logging.getLogger(__name__)

ENV_GRAPH_PDL = "MINISGL_GRAPH_PDL"  # "1" turns it on

# CUgraphNodeType / CUgraphDependencyType / CUgraphKernelNodePort values (cuda.h).
_NODE_KERNEL = 0
_DEP_PROGRAMMATIC = 1
_PORT_PROGRAMMATIC = 1

# Kernel names that are cuBLAS / cuBLASLt GEMMs (and their split-K reductions).
GEMM_NAME = re.compile(r"nvjet|gemm|xmma|cutlass|splitKreduce", re.IGNORECASE)


class _EdgeData(ctypes.Structure):
    _fields_ = [
        ("from_port", ctypes.c_ubyte),
        ("to_port", ctypes.c_ubyte),
        ("type", ctypes.c_ubyte),
        ("reserved", ctypes.c_ubyte * 5),
    ]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [
        ("func", ctypes.c_void_p),
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("kernelParams", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


class DriverError(RuntimeError):
    pass


@functools.cache
def _cuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _call(name: str, *args: object) -> None:
    rc = getattr(_cuda(), name)(*args)
    if rc != 0:
        raise DriverError(f"{name} failed with CUresult {rc}")


def _nodes(graph: int) -> list[int]:
    count = ctypes.c_size_t(0)
    _call("cuGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(count))
    nodes = (ctypes.c_void_p * count.value)()
    _call("cuGraphGetNodes", ctypes.c_void_p(graph), nodes, ctypes.byref(count))
    return [int(n or 0) for n in nodes[: count.value]]


Edge = tuple[int, int, tuple[int, int, int]]  # (from node, to node, (from_port, to_port, type))


def edges(graph: int) -> list[Edge]:
    count = ctypes.c_size_t(0)
    get = "cuGraphGetEdges_v2"
    _call(get, ctypes.c_void_p(graph), None, None, None, ctypes.byref(count))
    n = count.value
    src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (_EdgeData * n)()
    _call(get, ctypes.c_void_p(graph), src, dst, data, ctypes.byref(count))
    return [
        (int(src[i] or 0), int(dst[i] or 0), (data[i].from_port, data[i].to_port, data[i].type))
        for i in range(count.value)
    ]


def kernel_name(node: int) -> str | None:
    """The kernel's (mangled) name, or None when `node` is not a kernel node."""
    kind = ctypes.c_int(-1)
    _call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
    if kind.value != _NODE_KERNEL:
        return None
    params = _KernelParams()
    _call("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(params))
    name = ctypes.c_char_p()
    if params.func:
        _call("cuFuncGetName", ctypes.byref(name), ctypes.c_void_p(params.func))
    elif params.kern:
        _call("cuKernelGetName", ctypes.byref(name), ctypes.c_void_p(params.kern))
    return (name.value or b"?").decode(errors="replace")


def _set_edge(graph: int, src: int, dst: int, old: _EdgeData, new: _EdgeData) -> None:
    a, b = ctypes.c_void_p(src), ctypes.c_void_p(dst)
    _call("cuGraphRemoveDependencies_v2", ctypes.c_void_p(graph), ctypes.byref(a),
          ctypes.byref(b), ctypes.byref(old), ctypes.c_size_t(1))  # fmt: skip
    _call("cuGraphAddDependencies_v2", ctypes.c_void_p(graph), ctypes.byref(a), ctypes.byref(b),
          ctypes.byref(new), ctypes.c_size_t(1))  # fmt: skip


def rewrite(graph: int, into: Callable[[str], bool]) -> int:
    """Make every plain kernel -> kernel edge of `graph` whose destination's name satisfies `into`
    programmatic (triggered by the source's launch_dependents or end). Returns how many."""
    names = {node: kernel_name(node) for node in _nodes(graph)}
    done = 0
    for src, dst, (from_port, to_port, kind) in edges(graph):
        src_name, dst_name = names.get(src), names.get(dst)
        if src_name is None or dst_name is None or kind != 0 or not into(dst_name):
            continue
        old = _EdgeData(from_port, to_port, kind)
        _set_edge(graph, src, dst, old, _EdgeData(_PORT_PROGRAMMATIC, 0, _DEP_PROGRAMMATIC))
        done += 1
    return done


def edge_summary(graph: int) -> dict[str, int]:
    """Edges by (from_port, to_port, type), and kernel nodes by name family: for logs and probes."""
    names = {node: kernel_name(node) for node in _nodes(graph)}
    out: dict[str, int] = {}
    for _, dst, data in edges(graph):
        key = f"edge{data} -> {'gemm' if GEMM_NAME.search(names.get(dst) or '') else 'other'}"
        out[key] = out.get(key, 0) + 1
    return out


# ---- which GEMM kernels wait --------------------------------------------------------------------

_verified: dict[str, bool] = {}


def _late_writer():  # type: ignore[no-untyped-def]
    import triton
    import triton.language as tl

    @triton.jit
    def late_write(x_ptr, n, spin_ns, BLOCK: tl.constexpr):
        # Let the next kernel launch at once, then write x late: a kernel after this one reads
        # the new x only if it waits for this one's end.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        start = tl.extra.cuda.globaltimer()
        while tl.extra.cuda.globaltimer() - start < spin_ns:
            pass
        for i in range(0, n, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, tl.full([BLOCK], 1.0, x_ptr.dtype.element_ty), mask=offs < n)

    return late_write


def verify(
    shapes: Iterable[tuple[int, int, int]], dtype: torch.dtype, device: torch.device
) -> dict[str, bool]:
    """For each (M, K, N): capture [late writer of x (M x K)] -> x @ w.T (w: N x K) with the edge
    into the GEMM's kernels programmatic, replay, and record per GEMM kernel name whether its
    output used the late x. A name seen failing once stays failed."""
    late_write = _late_writer()
    for m, k, n in shapes:
        x = torch.zeros(m, k, dtype=dtype, device=device)
        w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
        out = torch.empty(m, n, dtype=dtype, device=device)

        def step(x: torch.Tensor = x, w: torch.Tensor = w, out: torch.Tensor = out) -> None:
            late_write[(1,)](x, x.numel(), 20_000, BLOCK=1024, launch_pdl=True)
            torch.mm(x, w.t(), out=out)

        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            step()
        raw = graph.raw_cuda_graph()
        gemms = {n for n in map(kernel_name, _nodes(raw)) if n and GEMM_NAME.search(n)}
        rewrite(raw, lambda name: bool(GEMM_NAME.search(name)))
        graph.instantiate()
        expected = w.float().sum(dim=1).to(dtype)  # every row of x is ones
        for _ in range(3):
            x.zero_()
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize(device)
            ok = bool(torch.allclose(out.float(), expected.float()[None, :].expand(m, n),
                                     rtol=2e-2, atol=2e-2))  # fmt: skip
            for name in gemms:
                _verified[name] = _verified.get(name, True) and ok
        del graph
    torch.cuda.empty_cache()
    return dict(_verified)


def enabled(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get(ENV_GRAPH_PDL, "0") != "1":
        return False
    from minisgl.kernels.common import pdl_enabled

    return pdl_enabled(device)


def rewrite_verified(graph: int, verify_shapes: Callable[[], Iterable[tuple[int, int, int]]],
                     dtype: torch.dtype, device: torch.device) -> int:  # fmt: skip
    """Rewrite edges into the GEMM kernels of `graph` that are known to wait; GEMM kernels not
    seen yet are verified first on `verify_shapes()` (the shapes that the graph's GEMMs have)."""
    names = {n for n in map(kernel_name, _nodes(graph)) if n and GEMM_NAME.search(n)}
    if names - _verified.keys():
        verify(verify_shapes(), dtype, device)
    unsafe = sorted(n for n in names if not _verified.get(n, False))
    if unsafe:
        logger.info("graph PDL: %d GEMM kernels keep plain edges (not verified to wait): %s",
                    len(unsafe), ", ".join(u[:60] for u in unsafe))  # fmt: skip
    return rewrite(graph, lambda name: _verified.get(name, False))
