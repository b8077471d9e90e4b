"""Command line: `python -m engine generate ...` (and the subcommands other modules add).

Bad input exits non-zero with a one-line reason on stderr; no traceback reaches a user.
"""

from __future__ import annotations

import argparse
import codecs
import importlib
import json
import os
import sys
from engine.acceptance import AcceptRule
from engine.decoding import DecodeConfig
from engine.drafters import DrafterSpec, drafter_names, vocab
from engine.errors import InputError
from engine.models import DTYPE_CHOICES
from engine.run import RunRequest, report, run
from engine.sampling import SamplingConfig
from engine.trace import Step

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3  # 1 is a failed quality gate
# subcommands defined next to what they run; each module has register(subparsers)
SUBCOMMAND_MODULES: tuple[str, ...] = ("engine.serving.cli", "engine.bench.cli", "engine.profiling")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=int, default=0)


def sampling_from_args(args: argparse.Namespace) -> SamplingConfig:
    return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="embedded", help="preset name, local folder or hub id")
    p.add_argument("--method", default="baseline", help="baseline, " + ", ".join(drafter_names()))
    p.add_argument("--k", type=int, default=4, help="draft length 1..16")
    p.add_argument("--adaptive", action="store_true", help="adapt k: +2 after a full accept, -1 otherwise")
    p.add_argument("--fit-k", action="store_true",
                   help="chains: draft each step as far as pays on this machine's measured verify curve and the "
                        "run's acceptance so far, --k at most; exact either way")
    p.add_argument("--draft", default=None, help="draft model for --method draft-model")
    p.add_argument("--ngram-max", type=int, default=3)
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--exit-layer", type=int, default=0, help="early-exit layers (0 = a quarter)")
    p.add_argument("--tree", default=None, help="mtp tree shape (default: chain)")
    p.add_argument("--draft-stop", type=float, default=0.0,
                   help="draft-model, early-exit, mtp chains: end a chain after a draft whose own probability "
                        "is below this (0 = always draft k); exact either way")
    p.add_argument("--lookup-first", type=int, default=0, metavar="N",
                   help="draft-model, early-exit, mtp: where the context's last N (up to --ngram-max) tokens "
                        "occurred before, draft what followed them (prompt lookup) instead of running the drafter; "
                        "0 = off; exact either way")
    p.add_argument("--lookup-join", action="store_true",
                   help="with --lookup-first and an mtp --tree: the lookup's drafts join the tree as one more "
                        "branch instead of replacing it (the tree is drafted and verified every step)")
    p.add_argument("--draft-vocab", choices=vocab.CHOICES, default=vocab.TRAINED,
                   help="trained draft model / MTP drafters: score only their shipped drafting vocabulary and the "
                        "request's own tokens (trained, default) or every token (full); the output is the same")
    p.add_argument("--draft-int8", choices=("on", "off"), default="on",
                   help="a trained MTP module: drafting steps multiply by int8 copies of its 16-bit weights on a "
                        "CPU (on, default: cheaper drafts) or by the weights themselves (off); the output is the same")
    p.add_argument(
        "--accept", choices=[r.value for r in AcceptRule], default=AcceptRule.EXACT.value,
        help="acceptance rule: exact (default) or typical (LOSSY, for teaching)",
    )


def drafter_from_args(args: argparse.Namespace) -> DrafterSpec:
    return DrafterSpec(
        method=args.method, draft=args.draft, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
        exit_layer=args.exit_layer, tree=args.tree, draft_vocab=args.draft_vocab, draft_stop=args.draft_stop,
        lookup_first=args.lookup_first, lookup_join=args.lookup_join, draft_int8=args.draft_int8 == "on",
    )


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as fh:
                return fh.read()
        except (OSError, UnicodeDecodeError) as err:
            raise InputError(f"cannot read prompt file {args.prompt_file!r}: {err.__class__.__name__}") from None
    if args.prompt is None:
        raise InputError("give a prompt with --prompt TEXT or --prompt-file F")
    return args.prompt


def cmd_generate(args: argparse.Namespace) -> int:
    request = RunRequest(
        prompt=read_prompt(args),
        model=args.model,
        raw=args.raw,
        decode=DecodeConfig(
            max_new_tokens=args.max_new_tokens, k=args.k, adaptive=args.adaptive, fit_k=args.fit_k,
            prefill_chunk=args.prefill_chunk, sampling=sampling_from_args(args), rule=AcceptRule(args.accept),
        ),
        drafter=drafter_from_args(args),
        dtype=args.dtype,
    )

    utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # a character split over steps prints once whole

    def stream(event) -> None:
        if isinstance(event, Step):
            sys.stdout.write(utf8.decode(b"".join(t.utf8 for t in event.emitted)))
            sys.stdout.flush()

    trace = run(request, on_event=None if args.json else stream)
    result = report(trace)
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
        return 0
    sys.stdout.write(utf8.decode(b"", final=True))  # bytes of a character the run stopped inside
    m = result["metrics"]
    extra = " [LOSSY acceptance: output distribution differs from the target's]" if trace.info.lossy else ""
    if m["draft_acceptance_rate"] is not None:
        extra += f", acceptance {m['draft_acceptance_rate']:.2f}, {m['mean_acceptance_length']:.2f} tokens/step"
    print(
        f"\n--\n{m['output_tokens']} tokens in {m['target_steps']} target steps, {m['tokens_per_s']:.1f} tokens/s, "
        f"TTFT {m['ttft_ms']:.0f} ms, ITL p50 {_fmt(m['itl_ms_p50'])} ms{extra} ({trace.stop_reason})",
        file=sys.stderr,
    )
    return 0


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m engine", description="Speculative Decoding Lab engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate text, plain or speculative")
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-file", default=None)
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--prefill-chunk", type=int, default=0, help="prefill in chunks of N tokens (0 = one forward)")
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="the target's dtype (auto: bfloat16 with batch-invariant kernels where this CPU has fast "
                        "bfloat16 instructions, else float32; the preset's if it sets one)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit 2."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("SPECLAB_ALLOW_ANY_MODEL", "1")  # the CLI user chooses what to load
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a bug: still one line, with where to look
        print(f"error: internal error ({err.__class__.__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})", file=sys.stderr)
        return EXIT_INTERNAL
