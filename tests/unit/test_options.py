"""Every subcommand's command line is one options dataclass (megatron_rrfp.options): the parser
holds exactly the dataclass's flags, the short layout spellings parse to the same typed options
as Megatron-LM's names, and options turn back into the flags that reproduce them."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_rrfp import options
from megatron_rrfp.bench.cli import BenchOptions
from megatron_rrfp.bench.compare import CompareOptions
from megatron_rrfp.cli import build_parser
from megatron_rrfp.goodput.cli import GoodputOptions
from megatron_rrfp.sim.cli import SHORT_LAYOUT_FLAGS, SimulateOptions
from megatron_rrfp.train.config import TrainConfig

COMMANDS = {"simulate": SimulateOptions, "bench": BenchOptions, "demo": BenchOptions, "compare": CompareOptions,
            "goodput": GoodputOptions, "train": TrainConfig}


def _subparsers():
    parser = build_parser()
    return parser, next(a for a in parser._actions if a.dest == "command").choices


def _parse(argv):
    parser, _ = _subparsers()
    args = parser.parse_args(argv)
    return options.from_namespace(COMMANDS[argv[0]], args)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_parser_holds_exactly_the_options_dataclass(command):
    _, sub = _subparsers()
    parsed = {a.dest: a.option_strings[0] if a.option_strings else a.dest for a in sub[command]._actions
              if a.dest != "help"}
    assert parsed == options.flags(COMMANDS[command])


def test_layout_flags_are_megatron_lms_names_with_the_short_forms_as_aliases():
    _, sub = _subparsers()
    for command in ("simulate", "bench", "demo"):
        strings = {a.dest: a.option_strings for a in sub[command]._actions}
        for name, (_, aliases) in SHORT_LAYOUT_FLAGS.items():
            if name in strings:
                assert strings[name] == ["--" + name.replace("_", "-"), *aliases], (command, name)
    short = _parse(["simulate", "--pp", "4", "--chunks", "2", "-m", "6", "--seeds", "1"])
    long = _parse(["simulate", "--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "2",
                   "--num-microbatches", "6", "--seeds", "1"])
    assert short == long
    assert (short.pipeline_model_parallel_size, short.virtual_pipeline_model_parallel_size,
            short.num_microbatches) == (4, 2, 6)
    bench = _parse(["bench", "--tp", "2", "--dp", "3", "--microbatches", "8"])
    assert (bench.tensor_model_parallel_size, bench.data_parallel_size, bench.num_microbatches) == (2, 3, 8)


def test_nested_options_parse_into_their_own_dataclass():
    o = _parse(["simulate", "--encoder-time", "0.5", "--expert-model-parallel-size", "2", "--img-h", "336"])
    assert o.workload.encoder_time_per_image == 0.5 and o.workload.expert_parallel == 2
    assert o.llava.img_h == 336 and o.llava.img_w is None
    assert _parse(["simulate"]) == SimulateOptions()  # the parser's defaults are the dataclass's


def test_demo_is_bench_with_its_own_defaults():
    bench, demo = _parse(["bench"]), _parse(["demo"])
    assert bench == BenchOptions()
    differing = {f.name for f in dataclasses.fields(BenchOptions) if getattr(bench, f.name) != getattr(demo, f.name)}
    assert differing == {"schedules", "out"} and demo.out == "rrfp-out/demo"


@pytest.mark.parametrize("argv", [
    ["simulate", "--pp", "4", "--reference", "--c50", "0.2", "--num-experts", "4", "--img-h", "224", "--json", "x"],
    ["bench", "--tp", "2", "--overlap-grad-reduce", "--buffer-limit", "1x,2x", "--moe-router-topk", "1", "--seed", "3"],
    ["goodput", "ledger.db", "--bins", "7"],
    ["compare", "a.json", "b.json"],
])
def test_options_turn_back_into_the_flags_that_reproduce_them(argv):
    parsed = _parse(argv)
    command = argv[0]
    assert _parse([command, *options.to_argv(parsed)]) == parsed
    assert options.to_argv(COMMANDS[command]()) == []  # the defaults need no flag
