"""Megatron's ``args`` checked for WLB-LLM, and what the packer and the cost model are built from.

``validate_wlb_args`` runs after Megatron's own ``validate_args``: it resolves the settings (``--wlb-config``
supplies defaults, explicit flags win), rejects combinations that cannot work with a message saying what to
change (``StartupError``: one line), and with pipeline parallelism turns on ``args.variable_seq_lengths``
(Megatron's validate_args forces it off) so that stages exchange per-micro-batch shapes. Megatron's args are
read through ``megatron_args.MegatronArgs``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Iterator
from typing import Any

from megatron_wlb.config import RunChoices, RunConfig, megatron_moe_fields
from megatron_wlb.costmodel import CostModel, ModelShape, ParallelLayout, build_cost_model
from megatron_wlb.data.blend import data_path_problems
from megatron_wlb.megatron.args.flags import _show, load_run_config, settings_from_args
from megatron_wlb.megatron.args.megatron_args import MegatronArgs
from megatron_wlb.megatron.args.settings import WlbSettings, setting_source
from megatron_wlb.packing.types import PackingConfig, resolve_max_seq_len
from megatron_wlb.requirements import missing_message, module_available

#: how a stock job's flags make Megatron's samples attend per document (what the balanced mode needs)
MASKING_FLAGS = "--reset-attention-mask --reset-position-ids (or --dataloader-inter-document-masking)"


def masking_problem(args: Any) -> str | None:
    """Why ``args`` do not mask attention per document the way the balanced concat-and-cut needs, or None.

    Without per-document masking every window of a stock job attends across its documents and costs
    the same, so there is nothing to balance, and pieces that attend only within themselves would be
    a silent change of the training."""
    a = MegatronArgs.of(args)
    inter, reset_mask, reset_pos = bool(a.dataloader_inter_document_masking), bool(a.reset_attention_mask), \
        bool(a.reset_position_ids)
    if inter or (reset_mask and reset_pos):
        return None
    if reset_mask:
        return ("--wlb-pieces concat-and-cut with --reset-attention-mask but not --reset-position-ids: Megatron's "
                "position ids then run on across documents, which pieces that restart at 0 cannot reproduce; add "
                "--reset-position-ids (or use --dataloader-inter-document-masking)")
    return ("--wlb-pieces concat-and-cut trains Megatron's samples regrouped per document, but this job attends "
            "across documents (every window then costs the same: nothing to balance); add " + MASKING_FLAGS +
            " to mask per document, or drop --wlb-pieces concat-and-cut")


def sft_problems(args: Any, settings: Any) -> list[str]:
    """What keeps ``--sft`` from running with WLB's flags, one line each (none: it runs)."""
    a = MegatronArgs.of(args)
    problems: list[str] = []
    if a.tokenizer_type != "SFTTokenizer":
        problems.append(f"--sft reads conversations through a chat template: give --tokenizer-type SFTTokenizer "
                        f"--tokenizer-model DIR (not {a.tokenizer_type})")
    if settings.pieces == "concat-and-cut":
        problems.append("--sft packs SFTDataset's conversations (sft.samples) as documents: --wlb-pieces "
                        "concat-and-cut cuts Megatron's GPT samples; use --wlb-pieces documents")
    if settings.cut == "any":
        problems.append("--sft trains each conversation's segment whole: packing.cut any would cut forced outliers; "
                        "use packing.cut split in the YAML of --wlb-config (a line over --seq-length is cut as "
                        "Megatron's SFTDataset cuts it)")
    problems.extend(data_path_problems(
        ((flag, getattr(a, flag)) for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path")),
        lambda flag, path: None if os.path.isfile(path) else (
            f"--{flag.replace('_', '-')} {path}: no such file; --sft reads a jsonl of "
            "{\"messages\": [...]} lines (as Megatron's SFTDataset)")))
    return problems


def num_microbatches_from_args(args: Any) -> int:
    """Micro-batches per DP rank per iteration: global_batch / (micro_batch x DP), as Megatron computes."""
    a = MegatronArgs.of(args)
    mbs, dp, gbs = int(a.micro_batch_size), int(a.data_parallel_size), int(a.global_batch_size)
    if gbs % (mbs * dp):
        raise ValueError(f"--global-batch-size {gbs} is not divisible by --micro-batch-size x DP = {mbs * dp}")
    return gbs // (mbs * dp)


class Refusal(Exception):  # noqa: N818 - a refusal, not an error of ours
    """A problem that stops the run with its one-line message on every rank that meets it (flags, data, a
    checkpoint that cannot be resumed, ranks that disagree): the entry points exit with it, no traceback."""


class StartupError(Refusal, ValueError):
    """A start-up problem (flags, data): the entry points exit with its one-line message, no traceback."""


class RunRefusal(Refusal, RuntimeError):
    """A refusal once the run is under way (a checkpoint it cannot resume, ranks whose plans or samples
    differ): the entry points exit with its one-line message, no traceback."""


def rejected_by_megatron(exc: BaseException) -> StartupError:
    """Megatron's own argument check that failed (an ``assert`` or ValueError of its ``validate_args``) as one line:
    its message (or the failed assertion's source line) and where it stands."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    what = " ".join(str(exc).split()) or (last.line if last is not None and last.line else type(exc).__name__)
    path = last.filename.replace(os.sep, "/") if last is not None else ""
    path = "megatron/" + path.rsplit("/megatron/", 1)[1] if "/megatron/" in path else os.path.basename(path)
    where = f" ({path}:{last.lineno})" if last is not None else ""
    return StartupError(f"megatron_wlb: Megatron's validate_args rejects these flags: {what}{where}")


@contextlib.contextmanager
def exit_on_startup_error() -> Iterator[None]:
    """Turn a ``Refusal`` (``StartupError``, ``RunRefusal``) into its message on stderr and ``SystemExit(1)``: an
    entry point exits with one line."""
    try:
        yield
    except Refusal as exc:
        # one write of the line and its newline: ranks that refuse together print whole lines, not interleaved
        sys.stdout.flush()
        os.write(2, (str(exc) + "\n").encode())
        raise SystemExit(1) from None


def configuration_error(problems: list[str], what: str = "invalid WLB-LLM configuration") -> StartupError:
    """One line naming every problem (each says what to change)."""
    listed = problems[0] if len(problems) == 1 else \
        f"{len(problems)} problems: " + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
    return StartupError(f"megatron_wlb: {what}: {listed}")


#: ``cp_comm_type`` of our CP attention (``--wlb-cp-sharding`` other than per-document-te): K/V all-gathered
CP_COMM_TYPE = "all_gather"

#: Megatron flags (megatron-core 0.19, main after PR #6742, dev, PR #7000) whose own machinery would replace or
#: bypass what our hooks feed: ``args`` attribute -> (flag, what it does, our equivalent). Each is refused at
#: start-up (``bypass_problems``), before Megatron's own checks of it (``refuse_bypassing_flags``).
#: ``--dataloader-inter-document-masking`` is not here: it is honoured (our micro-batches attend per document;
#: the balanced concat-and-cut intake cuts Megatron's samples at GPTDataset's document boundaries).
BYPASSING_FLAGS: dict[str, tuple[str, str, str]] = {
    "sequence_packing_scheduler": (
        "--sequence-packing-scheduler", "hands packing to Megatron's own data_schedule (wrap_data_iterator), which "
        "our data iterator replaces", "--wlb-packer wlb (our packer through our iterator); Megatron's own path "
        "takes our scheduler without apply(): python -m megatron_wlb.megatron.hooks.main_schedule pretrain_gpt.py ... "
        "--sequence-packing-scheduler wlb"),
    "use_varlen_dataset": (
        "--use-varlen-dataset", "builds Megatron's VarlenDataset (one unpacked document per sample for its "
        "scheduler), which our data path replaces", "--wlb-packer wlb with --data-path (whole documents packed "
        "into variable-length micro-batches)"),
    "dynamic_context_parallel": (
        "--dynamic-context-parallel", "picks a CP group size per sample (default_dynamic_cp) over data our CP "
        "sharding replaces", "--wlb-cp-sharding dynamic (a CP group size and ranks per micro-batch over the DP x "
        "CP ranks of a pipeline stage, planned with the packing and its CP communication priced), or "
        "--wlb-cp-sharding adaptive (per-sequence or per-document sharding chosen per micro-batch over "
        "--context-parallel-size)"),
    "hybrid_context_parallel": (
        "--hybrid-context-parallel", "picks a CP group size per sample over data our CP sharding replaces",
        "--wlb-cp-sharding dynamic (a CP group size and ranks per micro-batch over the DP x CP ranks of a "
        "pipeline stage), or --wlb-cp-sharding adaptive (per-sequence or per-document sharding chosen per "
        "micro-batch over --context-parallel-size)"),
    "max_seqlen_per_dp_cp_rank": (
        "--max-seqlen-per-dp-cp-rank", "caps what Megatron's own scheduler packs per rank, which our packer "
        "replaces", "--wlb-max-seq-len (a micro-batch's tokens over all CP ranks: this value x CP)"),
    "pipeline_p2p_fixed_shape": (
        "--pipeline-p2p-fixed-shape", "skips the pipeline stages' shape exchange, but our micro-batches differ in "
        "length", "nothing to set: WLB turns the shape exchange on (variable_seq_lengths) with PP > 1"),
}


def bypass_problems(args: Any) -> list[str]:
    """One problem per ``BYPASSING_FLAGS`` flag that ``args`` sets (each naming our equivalent); the shape flag
    only with pipeline parallelism, where shapes travel."""
    problems = []
    pp = MegatronArgs.of(args).pp
    for attr, (flag, does, ours) in BYPASSING_FLAGS.items():
        value = getattr(args, attr, None)  # the flags of BYPASSING_FLAGS, by name (several releases lack each)
        if value is None or value is False:
            continue
        if attr == "pipeline_p2p_fixed_shape" and pp <= 1:
            continue
        given = flag if value is True else f"{flag} {value}"
        problems.append(f"{given} {does}; remove it (our equivalent: {ours})")
    return problems


def refuse_bypassing_flags(args: Any) -> None:
    """Raise a one-line ``StartupError`` naming every ``BYPASSING_FLAGS`` flag ``args`` sets (called before
    Megatron's own validate_args, whose checks of these flags would not name our equivalent)."""
    problems = bypass_problems(args)
    if problems:
        raise configuration_error(problems)


def validate_wlb_args(args: Any, *, te_available: bool | None = None, highspy_available: bool | None = None,
                      check_files: bool = True) -> WlbSettings:
    """Check Megatron's validated ``args`` against the WLB settings; raise a ``StartupError`` (a ValueError, one
    line) saying what to change.

    With pipeline parallelism sets ``args.variable_seq_lengths = True`` (micro-batches differ in
    length, so stages exchange shapes; dense models also get the unused MoE dispatcher switched
    to ``alltoall``, which TransformerConfig requires); with CP > 1 and our CP attention sets
    ``args.cp_comm_type`` to ``all_gather`` (what it does); returns the resolved settings.
    ``te_available`` / ``highspy_available`` default to import probes; ``check_files=False`` skips
    the check that every ``--data-path`` prefix has its .bin/.idx (flag-parsing tests).
    """
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        raise configuration_error([str(exc)]) from None
    problems: list[str] = []
    a = MegatronArgs.of(args)  # read before the writes at the end (cp_comm_type, variable_seq_lengths)
    seq_length = int(a.seq_length)
    tp, cp, pp, dp = a.tp, a.cp, a.pp, a.dp

    if int(a.micro_batch_size or 1) != 1:
        problems.append(f"--micro-batch-size {a.micro_batch_size}: WLB packs variable-length THD micro-batches; "
                        "set --micro-batch-size 1 and put the batch size into --global-batch-size")
    if a.rampup_batch_size:
        problems.append("--rampup-batch-size changes the number of micro-batches per iteration, which the packer "
                        "fixes at start-up; remove --rampup-batch-size")
    if settings.max_seq_len is not None and settings.max_seq_len < seq_length:
        problems.append(f"--wlb-max-seq-len {settings.max_seq_len} is below --seq-length {seq_length}; raise "
                        f"--wlb-max-seq-len to at least {seq_length} or leave it unset")
    # the largest micro-batch: wlb packs up to S_max, the fixed packers up to seq_length
    largest = resolve_max_seq_len(seq_length, settings.max_seq_len) if settings.packer == "wlb" else seq_length
    max_pos = a.max_position_embeddings
    if a.position_embedding_type == "learned_absolute" and max_pos and largest > max_pos:
        problems.append(f"--max-position-embeddings {max_pos} is below the largest packed micro-batch ({largest} "
                        f"tokens; position ids restart per document but a document may fill it); raise "
                        f"--max-position-embeddings to {largest} or lower --wlb-max-seq-len")
    knobs = settings.knob_values()
    if knobs["max_seq_len"] is not None and knobs["max_seq_len"] < seq_length:
        knobs["max_seq_len"] = None  # reported above
    try:  # cross-field checks of the packer's own config (each knob alone was checked when parsed)
        packing = PackingConfig(seq_len=seq_length, n=1, **knobs)
    except ValueError as exc:
        problems.append(f"the packer settings (--wlb-* flags, --wlb-config) do not fit --seq-length {seq_length}: "
                        f"{exc}")
    else:
        threshold_problem = packing.queue_threshold_problem()
        if threshold_problem:
            source = setting_source("queue_thresholds")
            problems.append(f"{source} {_show(settings.queue_thresholds)}: {threshold_problem}")
    if seq_length % (2 * cp):
        problems.append(f"--seq-length {seq_length} must be divisible by 2 x --context-parallel-size = {2 * cp}")
    if settings.cp_sharding == "per-document-te":
        if te_available is None:
            te_available = module_available("transformer_engine")
        if not te_available:
            problems.append("--wlb-cp-sharding per-document-te keeps TransformerEngine's THD attention, but "
                            "transformer_engine is not installed; install TransformerEngine or choose "
                            "--wlb-cp-sharding per-document / adaptive (our all-gather CP attention)")
    if settings.packer == "fixed-solver":
        if highspy_available is None:
            highspy_available = module_available("highspy")
        if not highspy_available:
            problems.append("--wlb-packer fixed-solver needs the HiGHS MILP solver: pip install highspy, "
                            "or use --wlb-packer fixed-greedy / wlb")
    if settings.cost_profile is not None and not os.path.isfile(settings.cost_profile):
        problems.append(f"--wlb-cost-profile {settings.cost_profile}: no such file (make one with `wlb calibrate "
                        "--out PROFILE.json` on a GPU, or leave the flag out for the analytic model)")
    if a.mock_data:
        problems.append("--mock-data has no documents to pack; give --data-path PREFIX (Megatron .bin/.idx)")
    elif not (a.data_path or a.train_data_path):
        problems.append("no --data-path: WLB reads documents from Megatron indexed datasets (PREFIX.bin/.idx); "
                        "give --data-path [WEIGHT] PREFIX ... or --train-data-path")
    if check_files and not a.sft:  # --sft: jsonl files, checked by sft_problems
        problems.extend(data_path_problems(
            (("data_path", a.data_path), ("train_data_path", a.train_data_path),
             ("valid_data_path", a.valid_data_path), ("test_data_path", a.test_data_path)),
            lambda flag, prefix: None if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx") else (
                f"--{flag.replace('_', '-')}: no {prefix}.bin/.idx; give the prefix of a Megatron indexed dataset "
                "(made with tools/preprocess_data.py), without the extension")))
    problems.extend(bypass_problems(args))
    if a.fim_data:
        problems.append("--fim-data replaces the data path WLB installs; remove --fim-data or do not call "
                        "megatron_wlb.megatron.apply()")
    if a.sft and not module_available("transformers"):  # Megatron's SFTTokenizer loads the tokenizer with it
        problems.append(missing_message("transformers", "--sft (Megatron's SFTTokenizer)"))
    if a.sft:
        problems.extend(sft_problems(a, settings) if check_files else
                        [p for p in sft_problems(a, settings) if "no such file" not in p])
    if settings.pieces == "concat-and-cut":
        problem = masking_problem(a)
        if problem:
            problems.append(problem)
        if a.dataloader_type == "cyclic":
            problems.append("--wlb-pieces concat-and-cut follows MegatronPretrainingSampler's order (--dataloader-type "
                            "single); --dataloader-type cyclic reshuffles samples differently: use single")
    if a.dataloader_type == "external":
        problems.append("--dataloader-type external: WLB supplies the training iterator itself; use single or cyclic")
    cfg: RunConfig | RunChoices | None = None
    try:
        cfg = load_run_config(settings.config) if settings.config else None
    except ValueError as exc:
        problems.append(str(exc))
    if isinstance(cfg, RunConfig):  # a settings file (RunChoices) has no shape to check
        lay = cfg.layout
        if (lay.tp, lay.cp, lay.pp, lay.dp) != (tp, cp, pp, dp) or cfg.seq_len != seq_length:
            problems.append(f"--wlb-config {settings.config} describes TP{lay.tp} CP{lay.cp} PP{lay.pp} DP{lay.dp} "
                            f"with --seq-length {cfg.seq_len}, but this run is TP{tp} CP{cp} PP{pp} DP{dp} with "
                            f"--seq-length {seq_length}; pick the config of this layout or a settings file "
                            "(its packing, cp, cost, logging sections alone)")
        elif a.global_batch_size and int(a.global_batch_size) != cfg.packing.n * dp:
            problems.append(f"--wlb-config {settings.config} packs {cfg.packing.n} micro-batches per DP rank; "
                            f"set --global-batch-size {cfg.packing.n * dp} (= micro_batches x DP) "
                            "with --micro-batch-size 1")
    moe = bool(a.num_experts)
    dispatcher = a.moe_token_dispatcher_type
    if pp > 1 and moe and dispatcher == "allgather":
        problems.append("pipeline stages exchange variable-length activations (variable_seq_lengths), which "
                        "Megatron's allgather MoE token dispatcher does not support; set "
                        "--moe-token-dispatcher-type alltoall")
    try:  # model flags the cost model cannot price (--multi-latent-attention)
        megatron_moe_fields(args)
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        raise configuration_error(problems)
    comm = a.cp_comm_type
    if cp > 1 and settings.cp_sharding != "per-document-te" and comm is not None:
        # our CP attention all-gathers K/V (megatron_wlb.cp.attention), whatever --cp-comm-type says; Megatron-LM
        # dev's TransformerConfig refuses local attention at CP > 1 with any other value
        args.cp_comm_type = [CP_COMM_TYPE] * len(comm) if isinstance(comm, list) else CP_COMM_TYPE
    if pp > 1:
        # p2p must exchange each micro-batch's shape; Megatron's validate_args forces this off.
        args.variable_seq_lengths = True
        if not moe and dispatcher == "allgather":
            # TransformerConfig rejects variable_seq_lengths with the (default) allgather dispatcher
            # even for dense models, where the dispatcher is never used.
            args.moe_token_dispatcher_type = "alltoall"
    return settings


def packing_config_from_args(args: Any, settings: WlbSettings) -> PackingConfig:
    """The packer's config for this run: Megatron's seq_length, micro-batch count, DP size and seed,
    and every packer knob of the settings."""
    a = MegatronArgs.of(args)
    return PackingConfig(seq_len=int(a.seq_length), n=num_microbatches_from_args(a),
                         dp=int(a.data_parallel_size), seed=0 if a.seed is None else int(a.seed),
                         pipeline_stages=a.pp, virtual_stages=a.vpp, **settings.knob_values())


def cost_model_from_args(args: Any, settings: WlbSettings) -> CostModel:
    """The cost model W(d) for this run's model flags and layout (calibrated if --wlb-cost-profile)."""
    a = MegatronArgs.of(args)
    heads = int(a.num_attention_heads)
    kv = int(a.num_query_groups) if a.group_query_attention and a.num_query_groups else heads
    ffn = a.ffn_hidden_size or 4 * int(a.hidden_size)
    vocab = a.padded_vocab_size or a.vocab_size or 32000
    shape = ModelShape(name="megatron", hidden=int(a.hidden_size), num_layers=int(a.num_layers),
                       num_heads=heads, num_kv_heads=kv, ffn_hidden=int(ffn), vocab=int(vocab),
                       swiglu=bool(a.swiglu), **megatron_moe_fields(args))
    layout = ParallelLayout(tp=a.tp, cp=a.cp, pp=a.pp, dp=a.dp, ep=a.ep)
    return build_cost_model(shape, layout, profile=settings.cost_profile)
