"""Assembly: from a graph, an input shape and a budget to a frozen ``Plan`` the executor can run.

The pieces, each in its own module: ``facts`` (the annotating pass), ``costs`` (FLOPs and memory
terms), ``tile_memory`` (one tile), ``options`` (one segment), ``search`` (the dynamic program),
``baselines`` (plain PyTorch and checkpoint_sequential, for comparison), ``host_transfers`` (what a plan stages
through host memory). This module only calls them
in order and records the result, including every tiled segment's regions.
"""

from __future__ import annotations

import torch

from wsitrain.errors import PlanError
from wsitrain.sft.facts import GraphFacts, annotate
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.ops.report import fix_hint, tiling_report
from wsitrain.sft.plan_types import Plan, SegmentPlan
from wsitrain.sft.planning.baselines import baseline_peak, checkpoint_sequential_peak
from wsitrain.sft.planning.conv_limit import beyond_limit
from wsitrain.sft.planning.costs import TimeModel, device_kind, memory_terms
from wsitrain.sft.planning.host_transfers import staging_bytes, transfer_bytes
from wsitrain.sft.planning.kept_prefix import keep_prefix as kept
from wsitrain.sft.planning.kept_prefix import prefix_room
from wsitrain.sft.planning.options import PLAIN, TILED, SegOption, replay_path, segment_blocker
from wsitrain.sft.planning.search import (
    CHEAPEST,
    MAX_EXTRA_COMPUTE,
    State,
    extra_compute,
    fitting_plan,
    least_budget,
    plain_time,
    plan_time,
    search,
    smallest_plan,
    worth_running,
)
from wsitrain.sft.planning.session import PlanSession
from wsitrain.sft.planning.tile_memory import segment_regions
from wsitrain.sft.target import TargetDevice, target_for
from wsitrain.units import format_bytes


def new_session(
    graph: ModelGraph,
    input_shape: tuple[int, ...],
    act_dtype: torch.dtype,
    input_dtype: torch.dtype,
    device: str,
    input_on_host: bool,
    input_requires_grad: bool = False,
    optimizer: str | None = None,
    host_checkpoints: str = "auto",
    target: TargetDevice | None = None,
    time_model: TimeModel | None = None,
    reuse_tiles: bool = True,
    one_pass: bool = True,
) -> PlanSession:
    """``target``: the device's planning facts (default: by ``device``'s kind, detected where it is a GPU here)."""
    if host_checkpoints not in ("auto", "always", "never"):
        raise PlanError(f"host_checkpoints {host_checkpoints!r}", hint="use 'auto', 'always' or 'never'")
    tgt = target if target is not None else target_for(device)
    if tgt.kind != device_kind(device):
        raise PlanError(f"a {tgt.kind} target for a {device} plan", hint="plan for the target's own device kind")
    facts = annotate(graph, input_shape, act_dtype, input_dtype, input_requires_grad)
    terms = memory_terms(facts, tgt, optimizer)
    return PlanSession(facts, terms, device, input_on_host, host_checkpoints, tgt, time_model, reuse_tiles, one_pass)


def build_plan(
    graph: ModelGraph,
    model_name: str,
    input_shape: tuple[int, ...],
    budget: int,
    act_dtype: torch.dtype,
    input_dtype: torch.dtype,
    device: str,
    input_on_host: bool,
    input_requires_grad: bool = False,
    tile_size: int | None = None,
    checkpoints: list[str] | None = None,
    optimizer: str | None = None,
    host_checkpoints: str = "auto",
    target: TargetDevice | None = None,
    time_model: TimeModel | None = None,
    reuse_tiles: bool = True,
    one_pass: bool = True,
    keep_prefix: str = "auto",
) -> tuple[Plan, GraphFacts]:
    """Plan ``graph`` on ``input_shape`` within ``budget`` bytes; also returns the facts it planned on.
    ``keep_prefix``: a patch encoder's frozen prefix output kept for the recompute (planning/kept_prefix.py)."""
    if tile_size is not None and tile_size <= 0:
        raise PlanError(f"tile_size {tile_size} must be a positive number of pixels", hint="engine.tile_size")
    sess = new_session(
        graph, input_shape, act_dtype, input_dtype, device, input_on_host, input_requires_grad, optimizer,
        host_checkpoints, target, time_model, reuse_tiles, one_pass,
    )
    forced_cuts = _resolve_checkpoints(sess.facts, checkpoints) if checkpoints is not None else None

    def plain_pytorch(s: PlanSession) -> PlanSession:
        """Where the plan's plain-PyTorch figures come from (``_assemble``): the model as users run it, nothing
        folded (ops/fold_bn.py); ``s`` itself when nothing folds."""
        if not graph.fold_pairs():
            return s
        return new_session(
            graph.unfolded(), input_shape, act_dtype, input_dtype, device, input_on_host, input_requires_grad,
            optimizer, host_checkpoints, s.target, time_model, s.reuse_tiles, s.one_pass,
        )

    state = fitting_plan(sess, budget, tile_size, forced_cuts)
    if state is None and (lifted := beyond_limit(sess.target)) is not None:  # conv_limit.py: none within 2^31
        again = new_session(graph, input_shape, act_dtype, input_dtype, device, input_on_host, input_requires_grad,
                            optimizer, host_checkpoints, lifted, time_model, reuse_tiles, one_pass)  # fmt: skip
        found = fitting_plan(again, budget, tile_size, forced_cuts)
        sess, state = (again, found) if found is not None else (sess, state)
    notes: list[str] = []
    limiting: str | None = None
    if reuse_tiles and (state is None or not worth_running(sess, state, tile_size)):
        # The background entry (execution/reuse.py) costs an output tile and the segment's parameter gradients per
        # tile; where that is what does not fit, every tile computes instead: the budget is kept, the saving given
        # up (VGG-16, 20480 px, a 2080 Ti's 500 MiB: one tile 202 MiB with the entry). A plan that fits neither way
        # reports the budget it needs without the entry, the least that runs.
        sess = new_session(
            graph, input_shape, act_dtype, input_dtype, device, input_on_host, input_requires_grad, optimizer,
            host_checkpoints, sess.target, time_model, reuse_tiles=False, one_pass=one_pass,
        )
        state = fitting_plan(sess, budget, tile_size, forced_cuts)
        if state is not None and worth_running(sess, state, tile_size):
            notes.append(
                "background reuse off for this shape: its cache (an output tile and the segment's parameter "
                "gradients) does not fit the budget, so every tile computes"
            )
    if state is not None and not worth_running(sess, state, tile_size):
        t = max((o.tile for o in state.path if o.tile is not None), key=lambda c: c.bwd_peak, default=None)
        edge = t.core[0] if t else "?"
        smallest = smallest_plan(sess, tile_size, forced_cuts)
        least = least_budget(sess, smallest, tile_size, forced_cuts, short=budget) if smallest else None
        notes.append(
            f"only tiles of {edge} px fit, at {100 * extra_compute(sess, state):+.0f}% extra compute "
            f"(more than {100 * MAX_EXTRA_COMPUTE:+.0f}%): not worth running; {_raise_to(least)}, train in "
            "bf16, or read the slide at a coarser resolution"
        )
        plain = plain_pytorch(sess)
        p = _assemble(sess, plain, model_name, budget, state, False, notes, "one tile", least)
        return kept(sess, p, budget, keep_prefix), sess.facts
    if state is None:
        blocker = _first_blocker(sess, budget, tile_size, forced_cuts)
        if blocker is not None:
            node = sess.facts.nodes[blocker]
            raise PlanError(
                f"layer '{display_name(sess.facts, blocker)}' sits where activations must be tiled to fit "
                f"{format_bytes(budget)}, but it cannot be tiled: {node.spec.why_not}",
                hint=f"{fix_hint(node.spec)}; or fix the layer as said",
            )
        state = smallest_plan(sess, tile_size, forced_cuts)
        if state is None:
            raise PlanError(
                f"no plan exists for input {tuple(input_shape)}: the layers that would need tiling cannot be tiled",
                hint="freeze BatchNorm layers (model.freeze_bn) and use eval-mode Dropout in the trunk",
            )
        # the least budget that fits, not the smallest plan's estimated peak: a plan also keeps its headroom free,
        # so a budget of that peak does not fit (tiny at 16384 px on CPU: the peak 858 MiB, the least budget 974 MiB)
        least = least_budget(sess, state, tile_size, forced_cuts, short=budget)
        parts = floor_parts(sess, state)
        limiting = max(parts, key=lambda k: parts[k])
        what = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v)
        peak = sess.terms.scale_peak(replay_path(sess, state.path).peak)
        notes.append(
            f"DOES NOT FIT: {_needs(least)}; budget is {format_bytes(budget)}. The smallest plan's estimated peak "
            f"is {format_bytes(peak)}, and plans keep {100 * sess.terms.headroom:.0f}% of the budget above weights, "
            "optimizer state and workspaces free (headroom for the memory model's error). What does not shrink with "
            f"tiling: {what}; the largest is the {limiting}"
        )
        plain = plain_pytorch(sess)
        p = _assemble(sess, plain, model_name, budget, state, False, notes, limiting, least)
        return kept(sess, p, budget, keep_prefix), sess.facts
    plain = plain_pytorch(sess)
    p = kept(sess, _assemble(sess, plain, model_name, budget, state, True, notes, limiting), budget, keep_prefix)
    room = prefix_room(p)  # a frozen prefix the budget did not hold beside the plan: plan again leaving room for it
    if room and keep_prefix == "auto" and (again := fitting_plan(sess, budget - room, tile_size, forced_cuts)):
        q = kept(sess, _assemble(sess, plain, model_name, budget, again, True, notes, limiting), budget, keep_prefix)
        if worth_running(sess, again, tile_size) and q.fits and q.time_sft < p.time_sft:
            p = q  # smaller tiles and the prefix kept: the faster step
    return p, sess.facts


def _needs(least: tuple[int, bool]) -> str:
    """The least budget that fits, as the plan's note says it."""
    figure, found = least
    if not found:
        return f"needs a budget of more than {format_bytes(figure)}"
    return f"needs at least {format_bytes(figure)} (the least budget that fits)"


def _raise_to(least: tuple[int, bool] | None) -> str:
    """What to give the engine: the least budget that fits (printed rounded up, so the figure as read fits too)."""
    if least is None or not least[1]:
        return "give the engine more memory"
    return f"give the engine at least {format_bytes(least[0])}"


def display_name(facts: GraphFacts, i: int) -> str:
    """``features.1.0.block.3 (LayerNorm2d)``: the module path and the operator, as errors and plans name layers."""
    node = facts.nodes[i]
    return node.name if node.name.endswith(")") else f"{node.name} ({node.spec.type_name})"


def _tiling(sess: PlanSession, segments: tuple[SegmentPlan, ...]) -> tuple[str, ...]:
    f = sess.facts
    report = tiling_report([n.spec for n in f.nodes], f.trunk_end, lambda i: display_name(f, i))
    tiled = sum(len(s.layers) for s in segments if s.mode == TILED)
    return (f"{tiled} of {f.n} graph nodes run tiled in this plan; {report.lines()[0]}", *report.lines()[1:])


def floor_parts(sess: PlanSession, state: State) -> dict[str, int]:
    """Memory of the smallest plan that no tile size shrinks, by part (the answer to "why does it not fit")."""
    fused = bool(state.path) and state.path[-1].fused
    tiles = [o.tile.bwd_peak for o in state.path if o.tile is not None]
    return {
        "weights, gradients, optimizer state and workspaces": sess.terms.fixed + sess.facts.trainable_bytes,
        "head": sess.head_sim(fused)[0].peak,
        "checkpoints": sum(o.retained_add for o in state.path if o.mode == TILED and o.start),  # the image: below
        "plain activations": sum(o.retained_add for o in state.path if o.mode == PLAIN),
        "image": sess.device_bytes(0),
        "one tile": max(tiles, default=0),
    }


def _assemble(
    sess: PlanSession,
    plain: PlanSession,
    model_name: str,
    budget: int,
    state: State,
    fits: bool,
    notes: list[str],
    limiting: str | None = None,
    least: tuple[int, bool] | None = None,
) -> Plan:
    f = sess.facts
    # plain PyTorch's figures (baseline, checkpoint_sequential, FLOPs, time) on ``plain``: the model as users run
    # it, every BatchNorm its own kernel and saved map (DarkNet-19 at 10240 px: 108 GiB measured, 61 GiB planned
    # with the fold); the plan's own segments on ``sess``
    base = baseline_peak(plain)
    ck_peak, ck_segments = checkpoint_sequential_peak(plain)
    fused = bool(state.path) and state.path[-1].fused
    head_res, head_flops = sess.head_sim(fused)
    replayed = replay_path(sess, state.path).peak
    peak = sess.terms.scale_peak(replayed)
    segments = _segment_plans(sess, state.path, base if plain is sess else baseline_peak(sess))  # the engine's own
    staging = staging_bytes(sess, segments)
    tiled = [s for s in segments if s.mode == TILED]
    breakdown = {
        "parameters": sess.terms.model,
        "gradients": f.trainable_bytes,
        "optimizer": sess.terms.optimizer,
        "runtime": sess.terms.runtime,
        "checkpoints": sum(s.checkpoint_bytes for s in tiled if s.checkpoint_location == "device"),
        "gradient_buffers": max(
            (sess.grad_bytes(s.start) + (0 if s.fused_pool else sess.grad_bytes(s.end)) for s in tiled), default=0
        ),
        "tile_activations": max((s.tile_activation_bytes for s in tiled), default=0),
        "plain_activations": sum(o.retained_add for o in state.path if o.mode == PLAIN),
        "head": head_res.peak,
    }
    return Plan(
        model_name=model_name,
        input_shape=f.input_shape,
        dtype=str(f.act_dtype).replace("torch.", ""),
        input_dtype=str(f.input_dtype).replace("torch.", ""),
        device=sess.device,
        budget_bytes=int(budget),
        estimated_peak_bytes=peak,
        fits=fits and peak <= budget,
        segments=segments,
        breakdown=breakdown,
        baseline_peak_bytes=int(base),
        checkpoint_peak_bytes=int(ck_peak),
        checkpoint_segments=ck_segments,
        flops_plain=plain.plain_sim(0, plain.facts.trunk_end)[1] + plain.head_sim(fused)[1],
        flops_sft=state.flops + head_flops,
        recomputed_tiles=sum(s.n_tiles for s in tiled if not s.one_pass),
        input_on_host=sess.input_on_host,
        feature_map_bytes=sum(n.nbytes for n in f.nodes if not (n.spec.inplace or n.spec.alias)),
        limiting_part=limiting,
        min_budget_bytes=least[0] if least is not None and least[1] else None,
        host_bytes=(sess.nbytes(0) if sess.input_on_host else 0)
        + sum(2 * s.checkpoint_bytes for s in segments if s.start and s.checkpoint_location == "host")
        + staging,
        staging_bytes=staging,
        replayed_peak_bytes=int(replayed - sess.terms.runtime),
        tiling=_tiling(sess, segments),
        time_plain=plain_time(plain),
        time_sft=plan_time(sess, state),
        time_tiles=sum(o.cost for o in state.path if o.mode == TILED) if sess.reuse_tiles else 0.0,
        reuse_tiles=sess.reuse_tiles,
        transfer_bytes=transfer_bytes(sess, segments)
        + sum(5 * s.checkpoint_bytes for s in segments if s.start and s.checkpoint_location == "host"),
        notes=tuple(notes),
        target=sess.target,
    )


def _segment_plans(sess: PlanSession, path: tuple[SegOption, ...], base_peak: int) -> tuple[SegmentPlan, ...]:
    f = sess.facts
    segs = []
    retained = 0
    for k, opt in enumerate(path):
        t = opt.tile
        local = max(opt.local_fwd, opt.local_bwd + sess.grads_after[opt.end + 1])
        peak = sess.terms.scale_peak(sess.terms.fixed + retained + local)
        retained += opt.retained_add
        regions = segment_regions(f, opt.start, opt.end, t.edge) if t is not None else None
        tf = opt.fwd_tile
        fwd_regions = segment_regions(f, opt.start, opt.end, tf.edge) if tf is not None else None
        in_shape, out_shape = f.nodes[opt.start].shape, f.nodes[opt.end].shape
        segs.append(
            SegmentPlan(
                index=k,
                layers=tuple(f.name(i) for i in range(opt.start + 1, opt.end + 1)),
                mode=opt.mode,
                tile_grid=regions.grid if regions is not None else (1, 1),
                tile_edge=t.edge if t else max(out_shape[2:]),
                tile_shape=t.tile_shape if t else (in_shape[2], in_shape[3]),
                halo=t.halo if t else (0, 0),
                input_shape=in_shape,
                output_shape=out_shape,
                checkpoint_bytes=sess.nbytes(opt.start) if opt.mode == TILED else 0,
                checkpoint_location="host" if opt.in_host or (opt.start == 0 and sess.input_on_host) else "device",
                output_location="host" if k + 1 < len(path) and path[k + 1].in_host else "device",
                tile_activation_bytes=t.bwd_peak if t else 0,
                peak_bytes=min(peak, base_peak) if opt.mode == PLAIN and len(path) == 1 else peak,
                flops=opt.flops,
                fused_pool=f.fusion.kind if opt.fused and f.fusion is not None else None,
                start=opt.start,
                end=opt.end,
                in_place=tuple(sorted(sess.in_place(opt.start, opt.end))) if opt.mode == TILED else (),
                pointwise_matmul=sess.pointwise_matmul(opt.start, opt.end) if opt.mode == TILED else (),
                regions=regions,
                forward_grid=fwd_regions.grid if fwd_regions is not None else (),
                forward_tile_shape=tf.tile_shape if tf is not None else (),
                forward_tile_edge=tf.edge if tf is not None else 0,
                forward_regions=fwd_regions,
                one_pass=opt.one_pass,
            )
        )
    return tuple(segs)


def _first_blocker(
    sess: PlanSession, budget: float, tile_size: int | None, forced_cuts: list[int] | None
) -> int | None:
    """The untileable layer that stands where a plan would have to tile to fit, if that is why nothing fits."""
    limit = sess.terms.effective_budget(budget)
    state = search(sess, limit, CHEAPEST, tile_size, forced_cuts, tileable=lambda a, b: True)
    if state is None:
        return None
    for opt in state.path:
        if opt.mode == TILED:
            blocker = segment_blocker(sess, opt.start, opt.end)
            if blocker is not None:
                return blocker
    return None


def _resolve_checkpoints(facts: GraphFacts, names: list[str]) -> list[int]:
    """Node indices of forced checkpoint names (module paths, or torch.fx node names)."""
    by_name = {}
    for i in facts.cuts:
        by_name[facts.name(i)] = i
    bad = [n for n in names if n not in by_name]
    if bad:
        valid = ", ".join(facts.name(i) for i in facts.cuts[1:-1])
        raise PlanError(
            f"engine.checkpoints: {bad} are not cut points of this model",
            hint=f"a checkpoint must be a layer every path passes through; valid: {valid}",
        )
    return sorted({0, facts.trunk_end, *(by_name[n] for n in names)})
