"""The ``megakit`` command: one sub-command per feature, each defined in its own module.

A sub-command module exposes ``configure(parser)`` (add its flags) and
``run(args) -> int``. Modules are imported only when their sub-command runs, so
``megakit plan`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megakit.errors import UsageError

# name -> (module, one-line help)
COMMANDS = {
    "plan": ("megakit.commands.plan", "pick TP x PP x DP x ZeRO for a model and a cluster"),
    "schedule": ("megakit.commands.schedule", "print and draw a pipeline schedule"),
    "convert": ("megakit.commands.convert", "a megakit checkpoint to Hugging Face transformers' layout, or back"),
    "probe": ("megakit.commands.probe", "measure this machine into a hardware profile for megakit plan --hardware"),
    "doctor": ("megakit.commands.doctor", "run FAQ 6's loss-not-decreasing checks on a short real job"),
    "prepare-data": ("megakit.commands.prepare_data", "tokenize text into the shards train.py --data reads"),
    "generate": ("megakit.commands.generate", "continue a prompt with a trained checkpoint"),
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as one line with exit status 2 (its default status)."""

    def error(self, message: str) -> None:  # noqa: D102 - argparse API
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(wanted: str | None = None) -> argparse.ArgumentParser:
    """The full parser; only the ``wanted`` sub-command's flags are loaded."""
    parser = _Parser(prog="megakit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        # Only the chosen sub-command's module is imported (and its flags added).
        if name == wanted:
            importlib.import_module(module_name).configure(command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``megakit`` entry point: picks the sub-command and returns its exit status (2 for bad input)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args, passed_on = parser.parse_known_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    if passed_on and not getattr(module, "PASSES_UNKNOWN_FLAGS", False):  # doctor hands them to the trainer
        parser.error(f"unrecognized arguments: {' '.join(passed_on)}")
    args.passed_on = passed_on
    try:
        return int(module.run(args) or 0)
    except UsageError as error:
        print(f"megakit {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
