"""``megatron-rrfp train`` end to end on CPU (gloo, 2 local ranks = 2 pipeline stages).

Three short trainings share one layout and seed: rrfp (saving at iteration 3), 1f1b, and
rrfp resumed from the iteration-3 checkpoint. Their logged losses must agree: the
schedule changes the order, never the math, and a checkpoint holds all the state.
Every launch runs in its own process with a timeout (forked after torch's import:
helpers/cli_fork.py; one real subprocess tests the start-up); ``--nproc`` children die with
their parent, so a killed launch leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from helpers.train_cli import LAUNCH_TIMEOUT_S, LOSS_LINE, TINY, losses, memory, train  # noqa: F401


@pytest.fixture(scope="module")
def rrfp_run(tmp_path_factory):
    """rrfp with checkpoints, traces, TensorBoard, W&B (offline) and every timer."""
    out = tmp_path_factory.mktemp("rrfp")
    result = train(*TINY, "--pipeline-schedule", "rrfp", "--save", str(out / "ckpt"), "--save-interval", "3",
                   "--rrfp-trace-dir", str(out / "trace"), "--tensorboard-dir", str(out / "tb"),
                   "--log-timers-to-tensorboard", "--log-memory-to-tensorboard", "--timing-log-level", "1",
                   "--wandb-project", "rrfp-ci", "--wandb-exp-name", "tiny", "--wandb-save-dir", str(out / "wandb"),
                   env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    return out, result


@pytest.mark.timeout(200)
def test_rrfp_trains_logs_like_megatron_lm_and_writes_merged_traces(rrfp_run):
    out, result = rrfp_run
    found = losses(result)
    assert sorted(found) == [1, 2, 3, 4, 5, 6]
    assert found[6] < found[1] - 0.05, found  # learnable synthetic data: the loss falls
    assert "TP 1 x PP 2 x DP 1" in result.stdout and "schedule rrfp, fp32, cpu/gloo" in result.stdout
    lines = list(LOSS_LINE.finditer(result.stdout))
    assert [int(m.group(3)) for m in lines] == [8 * i for i in range(1, 7)]  # consumed samples
    assert all(float(m.group(5)) > 0 and float(m.group(9)) > 0 for m in lines)  # tokens/s, peak memory
    # Megatron's timer block after each line, with the rrfp-* breakdown
    assert result.stdout.count("(min, max) time across ranks (ms):") == 6
    assert re.search(r"^    rrfp-bubble \.+: \([\d.]+, [\d.]+\)$", result.stdout, re.MULTILINE), result.stdout
    assert sorted(os.listdir(out / "ckpt")) == ["iter_0000003", "iter_0000006", "latest_checkpointed_iteration.txt"]

    # one merged, common-clock trace per traced iteration (--log-interval 1: all six)
    assert sorted(os.listdir(out / "trace")) == [f"rrfp-iter{n}.json" for n in range(1, 7)]
    trace = json.loads((out / "trace" / "rrfp-iter6.json").read_text())
    events = trace["traceEvents"]
    tasks = {(e["pid"], e["name"]) for e in events if e.get("ph") == "X" and e["cat"] in ("F", "B")}
    assert tasks == {(rank, f"0{kind}{mb}") for rank in (0, 1) for kind in "FB" for mb in range(4)}, tasks
    # the default limit, 1x: never more forwards in flight than Megatron's PP = 2
    logged = memory(result)
    assert all(mb > 0 and n <= 2 for mb, n in logged.values()) and logged[1][1] == 2, logged
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == len(ends) == 8 and starts.keys() == ends.keys()  # 4 activations, 4 gradients
    assert all({starts[i]["pid"], ends[i]["pid"]} == {0, 1} for i in starts)
    # common clock: within a rank, send -> receive runs forward (slack: the clock offset estimate)
    assert all(ends[i]["ts"] >= starts[i]["ts"] - 2e3 for i in starts), [(starts[i], ends[i]) for i in starts]
    assert trace["otherData"]["ranks"]["1"]["order"].count("B") == 4


@pytest.mark.timeout(200)
def test_tensorboard_and_wandb_get_megatron_lm_tags(rrfp_run):
    """Read the event files back with TensorBoard's own reader; W&B's offline run file holds the same keys."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, result = rrfp_run
    logged = {int(m.group(1)): m for m in LOSS_LINE.finditer(result.stdout)}
    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    for tag in ("lm loss", "learning-rate", "grad-norm", "batch-size", "tokens-per-sec", "iteration-time",
                "mem-max-rss-bytes", "forward-backward-time", "optimizer-time", "rrfp-compute-time",
                "rrfp-bubble-time", "lm loss vs samples", "learning-rate vs samples"):
        assert tag in scalars, sorted(scalars)
    for step in range(1, 7):  # --tensorboard-log-interval 1, --log-interval 1: the same numbers as the log line
        line = logged[step]
        assert scalars["lm loss"][step] == pytest.approx(float(line.group(7)), rel=1e-5)
        assert scalars["learning-rate"][step] == pytest.approx(float(line.group(6)), rel=1e-5)
        assert scalars["grad-norm"][step] == pytest.approx(float(line.group(8)), abs=1e-3)
        assert scalars["iteration-time"][step] * 1e3 == pytest.approx(float(line.group(4)), abs=0.1)
        assert scalars["mem-max-rss-bytes"][step] / 2**20 == pytest.approx(float(line.group(9)), abs=0.01)
        assert scalars["rrfp-compute-time"][step] > 0 and scalars["forward-backward-time"][step] > 0
    assert sorted(scalars["lm loss vs samples"]) == [8 * i for i in range(1, 7)]

    [run_file] = list((out / "wandb").glob("wandb/offline-run-*/run-*.wandb"))
    data = run_file.read_bytes()  # protobuf records: the history keys are stored as plain strings
    for key in (b"lm loss", b"learning-rate", b"grad-norm", b"iteration-time", b"rrfp-bubble-time"):
        assert key in data, key


@pytest.mark.timeout(200)
def test_megatron_1f1b_gives_the_same_losses(rrfp_run):
    reference = losses(rrfp_run[1])
    megatron = train(*TINY, "--pipeline-schedule", "1f1b")
    ours = losses(megatron)
    assert ours.keys() == reference.keys()
    assert all(abs(ours[i] - reference[i]) <= 1e-5 for i in ours), (ours, reference)
    # Megatron's memory is measured too; at 1x (iteration 1) RRFP holds the same forwards
    megatron_memory, rrfp_memory = memory(megatron), memory(rrfp_run[1])
    assert all(n == 2 for _, n in megatron_memory.values()), megatron_memory
    assert megatron_memory[1][0] <= rrfp_memory[1][0] <= 1.1 * megatron_memory[1][0] + 0.01, \
        (megatron_memory, rrfp_memory)


@pytest.mark.timeout(200)
def test_resuming_at_iteration_3_continues_like_the_uninterrupted_run(rrfp_run):
    out, result = rrfp_run
    uninterrupted = losses(result)
    resumed = train(*TINY, "--pipeline-schedule", "rrfp", "--load", str(out / "ckpt"), "--load-iteration", "3",
                    "--rrfp-buffer-limit", "auto")  # auto changes the order and the memory, never the math
    assert "resumed from" in resumed.stdout and "at iteration 3" in resumed.stdout
    continued = losses(resumed)
    assert sorted(continued) == [4, 5, 6]
    # auto: the first iteration of this process at 1x (2 in flight), then sized to free RAM (capped at M = 4)
    logged = memory(resumed)
    assert logged[4][1] == 2 and all(mb > 0 and 1 <= n <= 4 for mb, n in logged.values()), logged
    assert resumed.stdout.count("megatron-rrfp: buffer limit auto") == 1, resumed.stdout
    assert all(abs(continued[i] - uninterrupted[i]) <= 1e-5 for i in continued), (continued, uninterrupted)


def train_in_process(capsys, *flags: str) -> tuple[int, str]:
    """``megatron-rrfp train FLAGS`` run by this process (exit status, stderr): for errors
    that must come before any rank starts (no launch needed to show it)."""
    from megatron_rrfp.cli import main

    capsys.readouterr()
    try:
        code = main(["train", *flags])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_bad_flag_exits_nonzero_naming_the_flag(capsys):
    code, err = train_in_process(capsys, *TINY, "--pipeline-schedule", "rrfp", "--rrfp-buffer-limit", "0")
    assert code != 0
    assert "--rrfp-buffer-limit" in err
    assert "Traceback" not in err


@pytest.mark.timeout(60)
def test_impossible_layouts_fail_before_starting_ranks(capsys):
    code, err = train_in_process(capsys, *TINY, "--pipeline-schedule", "rrfp", "--global-batch-size", "7")
    assert code == 2 and "--global-batch-size 7" in err
    code, err = train_in_process(capsys, "--cpu", "--nproc", "3", "--pipeline-model-parallel-size", "2")
    assert code == 2 and "world size 3 is not divisible by TP x PP = 1 x 2" in err


@pytest.mark.timeout(200)
def test_train_iters_1_with_every_other_default_trains_one_iteration_and_prints_no_python_warning():
    """Megatron-LM's default warmup (0) lets --train-iters 1 train; with the
    caller's warning choice unset (as a user runs it), no Python warning reaches the output
    (megatron-core's notes and torch's deprecation of what it calls fold into one line)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    result = subprocess.run([sys.executable, "-m", "megatron_rrfp.cli", "train", "--cpu", "--nproc", "2",
                             "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "rrfp", "--train-iters", "1",
                             "--log-interval", "1", "--timing-log-level", "2"],
                            capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.findall(r"iteration\s+(\d+)/\s*(\d+) \|", result.stdout) == [("1", "1")], result.stdout
    output = result.stdout + result.stderr
    assert not re.search(r"\w+Warning\b|warnings\.warn", output), output
    assert output.count("megatron-rrfp: Transformer Engine and Apex are not installed") == 1


# --------------------------------------------------------------------------- in-process


def test_flags_and_train_config_agree():
    from megatron_rrfp.train.config import TrainConfig, from_args, to_argv
    from megatron_rrfp.train.driver import build_parser

    parser = build_parser()
    assert from_args(parser.parse_args([])) == TrainConfig()
    config = from_args(parser.parse_args(TINY + ["--pipeline-schedule", "rrfp", "--rrfp-strict"]))
    assert from_args(parser.parse_args(to_argv(config, skip=()))) == config
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings}
    assert {"--model", "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--vocab-size",
            "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
            "--global-batch-size", "--train-iters", "--lr", "--min-lr", "--lr-warmup-iters", "--data-path",
            "--save", "--save-interval", "--load", "--log-interval", "--cpu", "--nproc",
            "--pipeline-schedule", "--rrfp-buffer-limit", "--rrfp-trace-dir", "--sequence-parallel",
            "--overlap-grad-reduce", "--use-distributed-optimizer"} <= flags


def test_samples_follow_megatrons_sampler():
    import torch

    from megatron_rrfp.train import data

    def source(dp_rank, **kw):
        return data.SyntheticTokens(vocab_size=64, seed=3, seq_length=8, micro_batch_size=2, dp_rank=dp_rank,
                                    dp_size=2, device=torch.device("cpu"), **kw)

    # micro-batch m of DP rank d holds samples consumed + m * mbs * dp + d * mbs + [0, mbs)
    batch = next(source(1).microbatches(consumed_samples=16, count=2))
    expected = np.stack([data.synthetic_tokens(i, 9, vocab_size=64, seed=3) for i in (18, 19)])
    assert torch.equal(batch["tokens"], torch.from_numpy(expected[:, :-1]))
    assert torch.equal(batch["labels"], torch.from_numpy(expected[:, 1:]))



def test_indexed_datasets_are_read_through_megatron_cores_gpt_dataset(tmp_path, monkeypatch):
    """A .bin/.idx written by megatron-core's own builder; samples are GPTDataset's, in
    Megatron's sampler order, and a token outside the vocabulary is named."""
    monkeypatch.setenv("RANK", "0")  # as on a rank: without a process group megatron-core 0.19 warns it assumes 0
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_rrfp.train import data

    documents = [np.arange(start, start + length) % 64 for start, length in ((0, 50), (7, 31), (20, 90), (3, 12))]
    prefix = data.write_indexed_dataset(str(tmp_path / "text_document"), documents)
    assert [d.tolist() for d in IndexedDataset(prefix)] == [d.tolist() for d in documents]
    common = dict(vocab_size=64, seq_length=8, micro_batch_size=2, dp_size=2, device=torch.device("cpu"),
                  num_samples=40, seed=5, build=True, cache_dir=str(tmp_path / "cache"))
    source = data.IndexedTokens(prefix, dp_rank=1, **common)
    stream = np.concatenate(documents)
    windows = {tuple(stream[i:i + 9]) for i in range(len(stream) - 8)}
    for index in range(12):
        sample = source.sample(index)
        assert sample[:-1].tolist() == source.dataset[index]["tokens"].tolist()  # megatron-core's sample
        if all(np.diff(sample) % 64 == 1):  # a window inside one document is a run of the stream
            assert tuple(sample) in windows
    batch = next(source.microbatches(consumed_samples=16, count=2))  # samples 18, 19 (DP rank 1)
    assert batch["tokens"].tolist() == [source.sample(i)[:-1].tolist() for i in (18, 19)]
    assert batch["labels"].tolist() == [source.sample(i)[1:].tolist() for i in (18, 19)]
    narrow = data.IndexedTokens(prefix, dp_rank=0, **{**common, "vocab_size": 32})
    with pytest.raises(ValueError, match="outside --vocab-size 32"):
        [narrow.sample(i) for i in range(40)]
    with pytest.raises(ValueError, match="no_such.bin not found"):
        data.IndexedTokens(str(tmp_path / "no_such"), dp_rank=0, **common)


def test_rank_comes_from_torchrun_then_slurm_then_defaults_to_one_process():
    from megatron_rrfp.launch.env import detect

    torchrun = detect({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "6000",
                       "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert (torchrun.source, torchrun.rank, torchrun.world_size, torchrun.local_rank) == ("torchrun", 3, 8, 1)
    slurm = detect({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "42",
                    "MASTER_ADDR": "node7"})
    assert (slurm.source, slurm.rank, slurm.world_size, slurm.master_addr, slurm.master_port) == \
        ("slurm", 1, 2, "node7", 20042)
    assert detect({}).source == "single"


@pytest.mark.timeout(400)
def test_dp2_pp2_interleaved_production_flags_same_losses_as_1f1b():
    """Megatron-LM's production DP flags over DP=2 x PP=2 x 2 model chunks (--num-layers 4: one
    layer per chunk): --overlap-grad-reduce --overlap-param-gather --use-distributed-optimizer.
    The default policy (B/W split active: no fallback line) trains like Megatron's interleaved 1F1B,
    with the DP communication in the task loop (CPU needs no rule) and out of it (--rrfp-dp-overlap
    after-loop: all-gathers before the loop, reductions after it)."""
    layout = [*TINY, "--nproc", "4", "--train-iters", "4", "--num-layers", "4",
              "--virtual-pipeline-model-parallel-size", "2", "--overlap-grad-reduce", "--overlap-param-gather",
              "--use-distributed-optimizer"]
    ours = train(*layout, "--pipeline-schedule", "rrfp", timeout=300)
    after_loop = train(*layout, "--pipeline-schedule", "rrfp", "--rrfp-dp-overlap", "after-loop", timeout=300)
    megatron = train(*layout, "--pipeline-schedule", "1f1b", timeout=300)
    assert "without the B/W split" not in ours.stdout + after_loop.stdout, ours.stdout[-2000:]
    assert "TP 1 x PP 2 x DP 2 (2 model chunks per rank)" in ours.stdout, ours.stdout[-2000:]
    assert "DP 2" not in ours.stdout.replace("x DP 2", "")  # in the loop: no line about where DP time goes
    assert ("megatron-rrfp: DP 2 x 2 chunks with --overlap-grad-reduce --overlap-param-gather: parameter "
            "all-gathers before the task loop, reductions after it (replicas independent) (--rrfp-dp-overlap "
            "after-loop)") in after_loop.stdout, after_loop.stdout[-2000:]
    a, b, c = losses(ours), losses(megatron), losses(after_loop)
    assert a.keys() == b.keys() == c.keys() == {1, 2, 3, 4}
    assert all(abs(a[i] - b[i]) <= 1e-5 and abs(c[i] - b[i]) <= 1e-5 for i in a), (a, b, c)
    assert len(set(a.values())) == 4, a  # the all-gathered weights change: no iteration repeats a loss
    norms = [{m.group(1): m.group(8) for m in LOSS_LINE.finditer(r.stdout)} for r in (ours, after_loop, megatron)]
    assert norms[0] == norms[1] == norms[2], norms  # the reduced gradients too


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pp", [2, 4])
def test_dp2_interleaved_epoch_rule_same_losses_as_megatron_with_and_without_the_split(pp):
    """--rrfp-dp-overlap epochs (the DP epoch rule, forced on CPU: the rounds transport over gloo)
    under DP=2 x PP x 2 chunks with the production DP flags: losses and grad norms equal to
    Megatron's interleaved 1F1B, with the default policy (B/W split) and with bf (no split)."""
    layout = [*TINY, "--nproc", str(2 * pp), "--pipeline-model-parallel-size", str(pp), "--train-iters", "3",
              "--micro-batch-size", str(4 // pp), "--num-layers", str(2 * pp), "--virtual-pipeline-model-parallel-size",
              "2", "--overlap-grad-reduce",
              "--overlap-param-gather", "--use-distributed-optimizer"]
    megatron = train(*layout, "--pipeline-schedule", "1f1b", timeout=400)
    runs = [train(*layout, "--pipeline-schedule", "rrfp", "--rrfp-dp-overlap", "epochs", *hint, timeout=400)
            for hint in ([], ["--rrfp-hint", "bf"])]
    for run in runs:
        assert ("megatron-rrfp: DP 2 x 2 chunks with --overlap-grad-reduce --overlap-param-gather: in the task loop "
                "at fixed DP points") in run.stdout, run.stdout[-2000:]
        assert "the DP epoch rule runs with" in run.stdout, run.stdout[-2000:]  # chosen after the measuring call
    assert "without the B/W split" not in runs[0].stdout, runs[0].stdout[-2000:]
    reference = losses(megatron)
    assert reference.keys() == {1, 2, 3}
    for run in runs:
        ours = losses(run)
        assert ours.keys() == reference.keys() and all(abs(ours[i] - reference[i]) <= 1e-5 for i in ours), \
            (ours, reference)
    norms = [{m.group(1): m.group(8) for m in LOSS_LINE.finditer(r.stdout)} for r in (megatron, *runs)]
    assert norms[0] == norms[1] == norms[2], norms


def test_interleaving_flags_are_checked_before_any_rank_starts():
    from megatron_rrfp.train.config import check_layout, from_args
    from megatron_rrfp.train.driver import build_parser

    def error(*flags: str, world: int | None = None) -> str:
        with pytest.raises(ValueError) as info:
            config = from_args(build_parser().parse_args([*TINY, *flags]))
            check_layout(config, world)
        return str(info.value)

    assert "--num-layers 2 is not divisible by --pipeline-model-parallel-size x --virtual-pipeline-model-parallel" \
        in error("--virtual-pipeline-model-parallel-size", "2")
    assert "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce" \
        in error("--overlap-param-gather", "--overlap-grad-reduce")
    assert "fewer than --pipeline-model-parallel-size 2" in error(
        "--num-layers", "4", "--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "4", world=4)


def test_sequence_parallel_needs_tensor_parallelism(capsys):
    code, err = train_in_process(capsys, *TINY, "--sequence-parallel")
    assert code != 0 and "--sequence-parallel needs --tensor-model-parallel-size > 1" in err


def test_collective_timeout_must_exceed_rrfp_timeout_plus_margin():
    """Both drivers (train's config and Megatron-LM's namespace) hold --distributed-timeout-minutes
    above --rrfp-timeout plus its margin: the default is raised, a lower explicit value refused."""
    from argparse import Namespace

    from megatron_rrfp.megatron_lm.flags import validate_rrfp_arguments
    from megatron_rrfp.train.config import from_args
    from megatron_rrfp.train.driver import build_parser

    rrfp = [*TINY, "--pipeline-schedule", "rrfp"]
    assert from_args(build_parser().parse_args(rrfp)).distributed_timeout_minutes == 20  # 600 s + 600 s
    assert from_args(build_parser().parse_args([*rrfp, "--rrfp-timeout", "60"])).distributed_timeout_minutes == 10
    with pytest.raises(ValueError, match=r"^--distributed-timeout-minutes 15 \(900 s\) is below --rrfp-timeout "
                                         r"600 s plus its margin \(1200 s in all\).*--distributed-timeout-minutes 20"):
        from_args(build_parser().parse_args([*rrfp, "--distributed-timeout-minutes", "15"]))
    megatron_lm = Namespace(pipeline_schedule="rrfp", rrfp_hint="default", rrfp_buffer_limit=16, rrfp_strict=False,
                            rrfp_timeout=900.0, rrfp_trace_dir=None, rrfp_goodput_ledger=None,
                            pipeline_model_parallel_size=2, distributed_timeout_minutes=10)
    validate_rrfp_arguments(megatron_lm)
    assert megatron_lm.distributed_timeout_minutes == 30  # 900 s + 900 s, in whole minutes
    assert from_args(build_parser().parse_args(TINY)).distributed_timeout_minutes == 10  # 1f1b: untouched


@pytest.mark.parametrize("flags", [
    ["--train-iters", "1"], ["--train-iters", "2"], ["--lr", "1e-5"], ["--lr", "0"],
    ["--pipeline-model-parallel-size", "3"], ["--pipeline-model-parallel-size", "8"],
    ["--tensor-model-parallel-size", "3"], ["--tensor-model-parallel-size", "8"], ["--micro-batch-size", "3"],
    ["--hidden-size", "50"], ["--hidden-size", "8"], ["--num-attention-heads", "3"], ["--num-layers", "3"],
    ["--num-experts", "1"], ["--num-experts", "3"], ["--vocab-size", "100"], ["--global-batch-size", "6"],
    ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "3"]])
def test_every_default_is_valid_whatever_one_other_flag_is(flags):
    """A default never refuses a value the user gave for another flag (Megatron-LM's
    warmup 0 and min-lr 0; layers, heads, width, vocabulary and global batch follow TP / PP / DP)."""
    from megatron_rrfp.train.config import check_layout, from_args, validate
    from megatron_rrfp.train.driver import build_parser

    config = from_args(build_parser().parse_args(["--cpu", *flags]))
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    assert config.num_layers % pp == 0 and config.num_attention_heads % tp == 0 and config.vocab_size % tp == 0
    assert config.hidden_size % config.num_attention_heads == 0 and config.lr_warmup_iters < config.train_iters
    for dp in (1, 2, 3) if "--global-batch-size" not in flags else (1,):
        sized = from_args(build_parser().parse_args(["--cpu", *flags]))
        assert check_layout(sized, tp * pp * dp) == dp
        validate(sized, world_size=tp * pp * dp)
        assert sized.global_batch_size % (sized.micro_batch_size * dp) == 0
