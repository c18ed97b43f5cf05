"""vLLM's own OpenAI server with no kvbranch code on its request path: the reference that the
integration tests compare greedy outputs with (the ``plain_server`` fixture).

``python -m server --no-connector`` is not that reference: it still loads the kvbranch endpoint
plugin (its guard, middleware and routes rewrite every request: cache hints, tool schemas,
sessions), so an "equals plain vLLM" check would put the same rewrite on both sides. Here the
launcher's flags are only turned into vLLM's arguments (:func:`server.launcher.cli.plan_launch`, so
the engine is configured the same: model, dtype, eager mode, KV cache size, tool parser), and then
vLLM's own server runs with ``VLLM_PLUGINS=""``: vLLM loads no plugin at all, neither kvbranch's
endpoint plugin nor its general (engine) plugin. What of kvbranch runs here is process management
only: stop with the test process (:func:`server.launcher.process.die_with_launcher`) and leave no
engine core behind (:func:`server.launcher.process.start_reaper`).

Run as ``python -m tests.vanilla_vllm --port N --no-connector <launcher flags>``.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    from server.launcher.cli import build_parser, plan_launch, split_passthrough
    from server.launcher.model_parsers import fit_parsers
    from server.launcher.model_support import parser_misfit
    from server.launcher.process import die_with_launcher, start_reaper

    ours, passthrough = split_passthrough(argv)
    args = build_parser().parse_args(ours)
    if not args.no_connector or args.role != "single":
        raise SystemExit("the vLLM reference runs without the connector, as a single instance")
    die_with_launcher(args.shutdown_grace_s)
    plan = plan_launch(args, passthrough)
    # Set before vLLM reads its environment: "" is an allow-list that names no plugin.
    os.environ["VLLM_PLUGINS"] = ""
    os.environ["VLLM_LOGGING_LEVEL"] = plan.env["VLLM_LOGGING_LEVEL"]

    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllm_args = make_arg_parser(FlexibleArgumentParser(prog="vllm")).parse_args(plan.vllm_argv)
    validate_parsed_serve_args(vllm_args)
    # The parsers the launcher chose by model, refitted to the model's tokenizer as the
    # launcher does (a tiny model folder carries another family's tokenizer).
    refit = fit_parsers(vllm_args, plan.chosen_parsers, parser_misfit)
    if refit:
        print(refit, file=sys.stderr, flush=True)
    start_reaper(plan.shutdown_grace_s)
    uvloop.run(run_server(vllm_args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
