"""The graph passes every compiled decode graph (or SuperKernel segment) gets before Inductor
(executor.backends.inductor calls `before_inductor`).

Each one corrects a choice Inductor's CPU heuristics make badly for a decode step, measured in
BENCHMARKS.md: large single-row GEMVs become generated reductions (MKL's sgemv streamed weights
at half the read bandwidth); batched linears become calls on weights packed once
(executor.backends.packed_linear); the attention's tiny batched products become reductions (one
extern bmm each cost more than the product); and values several kernels read (the decode mask,
RoPE's cos/sin) are stored once instead of recomputed in every layer's kernel. A graph compiled
for CUDA gets the stored-once values and the GEMV rewrite (for every single-row linear there:
cuBLAS's M = 1 kernels read small weights well below the HBM rate); the packing and the attention
rewrite are CPU lowerings.
"""

from __future__ import annotations

import operator

import torch

from executor.backends.eager_linear import aten_takes_single_rows, blas_linear_runs, gemv_in_graphs
from executor.backends.packed_linear import MIN_WEIGHT_NUMEL, call_instead, pack_batched_linears


def _stored(gm: torch.fx.GraphModule, node: torch.fx.Node, stride: tuple | None = None) -> torch.fx.Node:
    """A node that stores `node`'s value in a buffer of its own (Inductor's force_stride_order
    copy), inserted at the graph's current insertion point: what reads it can no longer inline
    (and so recompute) the pointwise chain that made the value. `stride`: for a node this pass
    made (no example value), the stride of the value it was made from."""
    import torch._inductor.inductor_prims  # registers prims.inductor_force_stride_order

    stride = stride or tuple(node.meta["example_value"].stride())
    return gm.graph.call_function(torch.ops.prims.inductor_force_stride_order.default, (node, stride))


INDUCTOR_DECOMPOSE_MAX_DIM = 2048  # Inductor's decompose_mm_pass only takes M=1 GEMMs with K, N <= this


def _gemv_to_reduction(gm: torch.fx.GraphModule, decomposes_small: bool = False, device: str = "cpu") -> int:
    """Rewrite `linear(x, W, b)` with a single row of x (decode, batch 1) as sum(x * W, -1) + b.

    Why: a decode step on CPU is a stream over the weights, and for large GEMVs (e.g. a 622 MB
    lm_head) MKL's sgemv streamed them at ~17 GB/s on the 2-core reference machine against ~35
    GB/s for the vectorised reduction Inductor generates from this form. Applied to every
    compiled CPU decode graph (ge_graph with or without SuperKernel). Where Inductor's own M=1
    decomposition runs (`decomposes_small`: a SuperKernel launch unit) it keeps the GEMVs it
    takes (K, N <= 2048); elsewhere those stay extern sgemv calls, so every GEMV of at least
    MIN_WEIGHT_NUMEL elements is rewritten there (the 0.6B shape's o_proj, 2048 x 1024: plain
    ge_graph left its 28 to sgemv, a lowering difference SK decoder was credited with). The
    input row is materialised first (Inductor's force_stride_order copy): left to Inductor, the
    norm before a projection was recomputed inside the reduction per weight row, which made the
    bf16 0.6B-shape step compute-bound (SK decoder 63 -> 37 ms/step once stored; BENCHMARKS.md).
    Where the GEMV kernel streams faster (bf16 without native bf16, fp32 without AVX-512: an AVX2
    host; bf16 in a launch unit) the large ones call it instead (`cann_cpu::gemv`;
    eager_linear.gemv_in_graphs says why). Where aten's single-row linear is MKL's fast sgemv (fp32
    on an Intel Xeon with AMX, eager_linear.aten_takes_single_rows) the large ones stay aten calls:
    there the 0.6B fp32 batch-1 step took 0.76x (ge_graph) and 0.80x (SK decoder) the reductions'
    time (8 of 8 alternating rounds each; BENCHMARKS.md, "fifty-seventh pass"). In a launch unit
    those Inductor's decomposition would take (the o_proj) call aten's linear through
    `cann_cpu::blas_linear`, which it does not see. Decomposed, the 28 o_proj loops (in the
    attention's fused kernels) took ~11% of the unit's step on one thread (perf), and the SK decoder
    step 1.019x ge_graph's on two threads (1.014x on one); with the call 0.986x that on two (faster in
    10 of 12 rounds in turns, one process) and 0.995x on one (6 of 10): level with ge_graph (1.005x,
    1.006x; BENCHMARKS.md, "eighty-second pass").

    On CUDA (`device`) every single-row linear is rewritten, small ones too: there Inductor sends
    each to cuBLAS, whose M = 1 kernels read the 0.6B shape's 4-13 MB projections at 0.7-2.2 TB/s
    on an H100 that streams ~2.7 (~5.7 us each), and split the 3072-deep one into a split-K kernel
    plus a reduction kernel, while the generated reductions are one kernel each, fused with what
    precedes them. The 0.6B bf16 batch-1 step went from 409 to 378 kernels and from 1.22 to 1.05
    ms of GPU time, and SK decoder from 2.14 to 1.53 ms/step (BENCHMARKS.md, "CUDA: one NVIDIA
    H100"; ge_graph went from 9.7 to 5.7 with the attention's products rewritten too, which graphs
    compiled for CUDA do not get: 1% of SK decoder's step at batch 1, unmeasured past it).
    Returns how many linears were rewritten either way.
    """
    rewritten, cpu = 0, device == "cpu"
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch._C._nn.linear:
            continue
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        value = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
        weight = w.meta.get("example_value") if isinstance(w, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.numel() != value.shape[-1] or weight is None:
            continue
        large = weight.numel() >= MIN_WEIGHT_NUMEL and weight.dim() == 2
        if cpu and large and aten_takes_single_rows(weight.dtype):
            if decomposes_small and max(weight.shape) <= INDUCTOR_DECOMPOSE_MAX_DIM and blas_linear_runs():
                # in a launch unit too: Inductor's decomposition would take the o_proj (2048 x 1024)
                call_instead(gm, node, torch.ops.cann_cpu.blas_linear.default)
                rewritten += 1
            continue
        if (
            cpu
            and large
            and value.dtype == weight.dtype
            and weight.stride(-1) == 1
            and gemv_in_graphs(weight.dtype, launch_unit=decomposes_small)
        ):
            call_instead(gm, node, torch.ops.cann_cpu.gemv.default)
            rewritten += 1
            continue
        small = max(weight.shape) <= INDUCTOR_DECOMPOSE_MAX_DIM
        if cpu and small and (decomposes_small or not large):
            continue  # Inductor's decomposition does these better; small ones sit in cache anyway
        with gm.graph.inserting_before(node):
            # Store the input row before the reduction reads it: otherwise Inductor inlines the
            # pointwise chain that made it (the residual add and RMSNorm) into the reduction's
            # body and recomputes it for every one of the N output rows. A bf16/fp16 row on CPU is
            # stored widened to fp32, which the reduction computes in anyway: left narrow, the
            # reduction converted the whole row again for every weight row, and streamed a 0.6B
            # lm_head at ~44 GB/s where a sum read 62-65 (BENCHMARKS.md, "fortieth pass").
            widen = cpu and value.dtype in (torch.bfloat16, torch.float16)
            convert = torch.ops.prims.convert_element_type.default
            # widened from a stored copy: Inductor folds fp32 -> bf16 -> fp32 chains, which would
            # skip the rounding the row had in the model (and in eager)
            src = gm.graph.call_function(convert, (_stored(gm, x), torch.float32)) if widen else x
            row = gm.graph.call_method("unsqueeze", (_stored(gm, src, tuple(value.stride())), -2))  # (..., 1, K)
            out = gm.graph.call_method("sum", (gm.graph.call_function(operator.mul, (row, w)), -1))  # (..., N)
            if widen:  # the linear's own result dtype, rounded once as before
                out = gm.graph.call_function(convert, (out, value.dtype))
            if bias is not None:
                out = gm.graph.call_function(operator.add, (out, bias))
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        rewritten += 1
    gm.recompile()
    return rewritten


ATTENTION_MAX_ROWS = 16  # query rows per KV head in decode: Hq / Hkv query heads x 1 token
REDUCED_PRECISION_MAX_SLOTS = 256  # bf16/fp16 products over more cache slots stay BLAS bmm calls


def _attention_matmuls_to_reductions(gm: torch.fx.GraphModule) -> int:
    """Rewrite the decode attention's two products, `matmul(a, b)` of activations whose `a` has
    at most ATTENTION_MAX_ROWS rows (the query heads sharing a KV head), as
    sum(a[..., :, :, None] * b[..., None, :, :], -2): one generated reduction each, fused with
    the scale, mask and softmax around it.

    Why: as matmuls they became one extern `bmm` each, and at decode shapes a bmm is a batch of
    B x Hkv tiny products whose per-call cost dominates (0.6B shape, 33 cache slots, one layer's
    attention compiled: bf16 86-188 -> 35 us at batch 1, 223 -> 169 us at batch 16, 575-844 ->
    475-525 us at batch 64; fp32 1272 -> 769 us at batch 64; BENCHMARKS.md "eleventh pass").
    In fp32 the reductions were as fast or faster at every size measured (2048 slots: 2x). In
    bf16 they lost to oneDNN's bmm once the slots are many (2048 slots at batch 1: 1.35x slower),
    so reduced-precision products are rewritten only up to REDUCED_PRECISION_MAX_SLOTS slots
    (the static cache length, known when the graph is compiled). Inductor keeps the products and
    the sum in fp32 inside the kernel, as the bmm accumulates. Any product of activations with
    that few rows qualifies; in the recipes' decode graphs those are the attention's. Returns how
    many were rewritten.
    """
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.matmul or len(node.args) != 2:
            continue
        a, b = (x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None for x in node.args)
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() < 3 or a.dim() != b.dim():
            continue
        if a.shape[-2] > ATTENTION_MAX_ROWS:
            continue
        if a.dtype != torch.float32 and max(a.shape[-1], b.shape[-1]) > REDUCED_PRECISION_MAX_SLOTS:
            continue
        with gm.graph.inserting_before(node):
            # Store the rows first (the roped query, the softmax): inlined, they were recomputed
            # for every cache slot (0.6B shape, batch 64: 1.09 ms per layer, against 0.86 for bmm).
            rows = gm.graph.call_method("unsqueeze", (_stored(gm, node.args[0]), -1))  # (..., M, K, 1)
            cols = gm.graph.call_method("unsqueeze", (node.args[1], -3))  # (..., 1, K, N)
            out = gm.graph.call_method("sum", (gm.graph.call_function(operator.mul, (rows, cols)), -2))
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _lower_cpu_gemms(gm: torch.fx.GraphModule, decomposes_small: bool) -> None:
    """The decode GEMMs' CPU lowerings, before Inductor: large single-row ones become generated
    reductions, batched ones calls on weights packed once (oneDNN, or this project's kernel:
    executor.backends.packed_linear), the attention's small batched products reductions."""
    _gemv_to_reduction(gm, decomposes_small)
    pack_batched_linears(gm)
    _attention_matmuls_to_reductions(gm)


def _opaque(node: torch.fx.Node) -> bool:
    """A call Inductor cannot look into (a custom op: it runs as an extern kernel)."""
    target = node.target
    if node.op != "call_function":
        return False
    if isinstance(target, torch._ops.OpOverloadPacket):  # what Dynamo records for `torch.ops.ns.op(...)`
        target = getattr(target, target.overloads()[0])
    return isinstance(target, torch._ops.OpOverload) and target.namespace not in ("aten", "prims", "sk")


def _store_once(gm: torch.fx.GraphModule, node: torch.fx.Node, users: list[torch.fx.Node]) -> None:
    """Make `users` read `node`'s value from one stored buffer instead of each inlining the
    pointwise chain that made it."""
    with gm.graph.inserting_after(node):
        once = _stored(gm, node)
    for user in users:
        user.replace_input_with(node, once)


def _store_shared_opaque_inputs(gm: torch.fx.GraphModule) -> int:
    """Store once a computed tensor that several custom-op calls read.

    Why: Inductor inlines a cheap pointwise value into each consumer, and an extern consumer
    needs it stored, so each one got its own copy computed again. The decode mask (B, 1, 1,
    max_len) feeds every layer's `cann::decode_attention`: recomputed per layer it cost ~0.7 ms
    per step at 16k slots on the bench-overhead model (8 layers; a bool store per slot), i.e. a
    step that grew with max_len although the op reads only the valid slots. Returns how many
    values are now stored once."""
    stored = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.meta.get("example_value"), torch.Tensor):
            continue
        users = [u for u in node.users if _opaque(u)]
        if len(users) < 2:
            continue
        _store_once(gm, node, users)
        stored += 1
    if stored:
        gm.recompile()
    return stored


_TRIG = {torch.cos, torch.sin, "cos", "sin", torch.ops.aten.cos.default, torch.ops.aten.sin.default}


def _store_shared_trig(gm: torch.fx.GraphModule) -> int:
    """Store once a cos / sin value (or what it becomes: a cast, a view) that several nodes read.

    Why: Inductor recomputes a pointwise value in every kernel that reads it unless it judges the
    value costly, and on CPU it counts exp, log, sigmoid and tanh as costly but not cos, sin or
    pow. The RoPE cos/sin of a decode step (B, 1, 1, head_dim), computed once by the model, are
    read by the q and k rotation of every layer, so each layer's kernel computed pow, cos and
    sin again for every head. That layer kernel took 0.56 ms, and 0.17 ms with the values stored
    once, at the 0.6B shape in bf16, batch 64 (BENCHMARKS.md, "tenth pass"). Stored once, a read
    is a load; the stored value is also the one eager mode uses (rounded to the model dtype
    before the multiply). Returns how many values are now stored once."""
    stored = 0
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method") or node.target not in _TRIG:
            continue
        shared = node
        while len(shared.users) == 1:  # through the cast / unsqueeze to the value that fans out
            shared = next(iter(shared.users))
        if len(shared.users) < 2 or not isinstance(shared.meta.get("example_value"), torch.Tensor):
            continue
        _store_once(gm, shared, list(shared.users))
        stored += 1
    if stored:
        gm.recompile()
    return stored


def before_inductor(gm: torch.fx.GraphModule, device: str, launch_unit: bool = False) -> None:
    """The graph passes every compiled decode graph (or SuperKernel segment) gets; `launch_unit`:
    compiled as one SuperKernel launch unit (CPU_LAUNCH_UNIT)."""
    _store_shared_opaque_inputs(gm)
    _store_shared_trig(gm)
    if device == "cpu":
        _lower_cpu_gemms(gm, decomposes_small=launch_unit)
    elif device == "cuda":
        _gemv_to_reduction(gm, device=device)
    _give_example_values(gm)


def _give_example_values(gm: torch.fx.GraphModule) -> None:
    """Give the nodes the passes above call a method on (and what those need) the example value
    Dynamo gives its own nodes: a fake tensor, computed from the inputs' values.

    Why: AOTAutograd's cache bypasses a graph in which a method is called on a node without one
    ("Unsupported call_method target"), and the rewrites call `unsqueeze` and `sum` on nodes
    they insert. Such a graph went through AOTAutograd again on every run whose Inductor cache
    was warm: 2-3 s of the default run's start (BENCHMARKS.md, "thirty-third pass"). Run last, so
    no pass above sees a value it did not see before. Only from Dynamo's fake mode (the graph
    inputs'): a node whose inputs have no value, or one in another mode, keeps none."""
    from torch._subclasses.fake_tensor import FakeTensor

    need: set[torch.fx.Node] = set()
    todo = [n.args[0] for n in gm.graph.nodes if n.op == "call_method" and isinstance(n.args[0], torch.fx.Node)]
    while todo:
        node = todo.pop()
        if node in need or "example_value" in node.meta or node.op not in ("call_function", "call_method"):
            continue
        need.add(node)
        todo.extend(node.all_input_nodes)
    inputs = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = next((v.fake_mode for v in inputs if isinstance(v, FakeTensor)), None)  # Dynamo's
    if not need or mode is None:
        return
    missing = object()
    with mode:
        for node in gm.graph.nodes:  # in order: a node's inputs get their values first
            if node not in need:
                continue
            args, kwargs = torch.fx.node.map_arg(
                (node.args, node.kwargs), lambda a: a.meta.get("example_value", missing)
            )
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            if any(a is missing or (isinstance(a, FakeTensor) and a.fake_mode is not mode) for a in leaves):
                continue
            fn = getattr(args[0], node.target) if node.op == "call_method" else node.target
            node.meta["example_value"] = fn(*(args[1:] if node.op == "call_method" else args), **kwargs)
