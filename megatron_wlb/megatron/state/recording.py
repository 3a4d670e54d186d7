"""The step timing of a training run: this rank's ``timing.Recorder``, started with the first training
iterator, and its per-iteration flush and measurement (the online cost-model refit rides on both). Imports torch
and Megatron (``training_hooks`` imports it)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import package_info, parallel_state

from megatron_wlb.cp.dynamic import DYNAMIC_SHARDING
from megatron_wlb.megatron.args.megatron_args import MegatronArgs
from megatron_wlb.megatron.args.settings import WlbSettings
from megatron_wlb.megatron.data.device import training_device
from megatron_wlb.megatron.state import timing
from megatron_wlb.megatron.state.online import start_online_refit
from megatron_wlb.megatron.state.process import runtime
from megatron_wlb.provenance import machine

if TYPE_CHECKING:
    from megatron_wlb.costmodel import CostModel


def start_recorder(args: Any, settings: WlbSettings, n: int, cost: CostModel | None) -> None:
    """Time this rank's training steps from now on (``timing.Recorder``; a trace file with ``--wlb-trace``)."""
    a = MegatronArgs.of(args)
    pp, vpp = a.pp, a.vpp
    ids = timing.RankIds(rank=torch.distributed.get_rank(), dp=parallel_state.get_data_parallel_rank(),
                         pp=parallel_state.get_pipeline_model_parallel_rank(),
                         cp=parallel_state.get_context_parallel_rank(),
                         tp=parallel_state.get_tensor_model_parallel_rank(),
                         dp_size=parallel_state.get_data_parallel_world_size(),
                         cp_size=parallel_state.get_context_parallel_world_size(),
                         tp_size=parallel_state.get_tensor_model_parallel_world_size(),
                         layers_per_chunk=max(1, int(a.num_layers) // (pp * vpp)),
                         dynamic=settings.cp_sharding == DYNAMIC_SHARDING)
    cuda = training_device().type == "cuda"
    layout = {"tp": ids.tp_size, "cp": ids.cp_size, "pp": pp, "dp": ids.dp_size, "vpp": vpp}
    header = {"device": torch.cuda.get_device_name() if cuda else machine(),
              "model": cost.model.to_dict() if cost is not None else None,
              "layout": layout, "n": n,
              "cost_model": cost.describe() if cost is not None else None, "settings": settings.to_dict(),
              "megatron_core": str(package_info.__version__), "torch": torch.__version__}
    registry = runtime().registry

    def chunk_of(iterator: Any) -> int | None:
        return next((i for i, it in enumerate(registry.iterators) if it is iterator), None)

    thread = os.environ.get("WLB_TRACE_CLOCK", "") == "thread"  # thread CPU seconds: for fitting a cost model
    clock = timing.CudaClock() if cuda else timing.ThreadClock() if thread else timing.CpuClock()
    recorder = timing.Recorder(clock, ids, cost, n, chunk_of,
                               trace=settings.trace, header=header)
    timing.activate(recorder)
    if settings.cost_model == "online" and cost is not None:
        runtime().refit = start_online_refit(cost, layout, settings.refit_interval, recorder)


def measure(due: bool) -> Any:
    """Flush this rank's timing (trace rows) and, on a logged iteration, measure over every rank."""
    recorder = timing.active()
    if recorder is None:
        return None
    start = time.perf_counter()
    try:
        target = recorder.log_target
        rows = recorder.flush(through=target)
        refit = runtime().refit
        if refit is not None:
            refit.observe(rows)
            if target >= 0 and refit.due(target):
                state = refit.refit(target, timing.all_reduce)  # before the next plan: every rank alike
                if state is not None:
                    recorder.write({"kind": "refit", "iteration": target, "state": state})
        if not due or target < 0:
            return None
        return recorder.measure(target, timing.all_reduce)
    finally:
        recorder.overhead_s += time.perf_counter() - start
