"""The ``mars`` command line: ``mars demo``, ``centroids``, ``debias``, ``evaluate``, ``report``.

Parses (:mod:`mars_plugin.commands.cli_parser`: every flag states its default in ``--help``) and
dispatches to the commands (:mod:`mars_plugin.commands`). Folder layout: see
:mod:`mars_plugin.formats.files`.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, List, Optional

from mars_plugin import _interrupt
from mars_plugin._checks import MAX_THREADS, check_int_param
from mars_plugin.commands.cli_parser import build_parser


def apply_threads(n: Optional[int]) -> None:
    """Set torch's and (when installed) numba's CPU thread count to ``n`` (None: leave both)."""
    if n is None:
        return
    n = check_int_param(n, "threads", 1, MAX_THREADS)
    import torch

    torch.set_num_threads(n)
    try:
        import numba
    except ImportError:
        return
    # numba's pool has NUMBA_NUM_THREADS threads at most (one per core unless set).
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


def _maybe_init_distributed(train: Optional[str] = None) -> bool:
    """Join the process group that torchrun describes in the environment (gloo, CPU tensors;
    ``mars train`` on GPUs: nccl, given its ``--device``)."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    backend = "gloo"
    if train is not None and train != "cpu":
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    return True


# Python parameter names that core checks and the jobs put in their messages, and the flags that
# set them (a parameter whose flag has another name, e.g. images_dir, maps to that flag).
_FLAGS = {name: "--" + name.replace("_", "-") for name in (
    "crf_params", "crf_backend", "batch_size", "num_classes", "k_fg", "k_bg", "spill_mb", "spill_dir",
    "image_labels", "ignore_index", "num_examples", "class_names", "on_error", "per_class", "num_train",
    "num_val", "trust_pickle", "loss_grid", "min_size", "max_size", "iter_size", "output_stride", "lr_step",
    "weight_decay", "crf_image")}
_FLAGS.update(images_dir="--images", features_dir="--features", labels_dir="--labels", out_dir="--out",
              pred_dir="--pred", gt_dir="--gt", debiased_dir="--debiased", pseudo_dir="--pseudo",
              file_format="--format", flip_average="--flip")
# One-word parameters are also English words ("the heads file"): written as flags only where the
# sentence is about the parameter ("workers must be >= 1", "refine='crf'").
_WORD_FLAGS = ("workers", "device", "alpha", "threshold", "refine", "seed", "size", "epochs", "stride", "res",
               "scales", "uss", "backend", "iterations", "data", "domain", "momentum", "optimizer", "flip")
_EDGE = r"(?<![\w/\\.-])"  # not inside a path or a longer name
_END = r"(?![\w/\\-]|\.\w)"


def _flag_names(msg: str) -> str:
    """A core error message with its parameter names written as the command line's flags:
    ``name='value'`` and ``name=value`` as ``--name value``, ``crf_params['key']`` as
    ``--crf-params "key"``, ``batch_size`` as ``--batch-size`` (``images_dir`` as ``--images``), and
    ``workers must`` as ``--workers must``. Paths and double-quoted JSON text are left as they are."""
    every = {**_FLAGS, **{w: "--" + w for w in _WORD_FLAGS}}
    names = "|".join(sorted(every, key=len, reverse=True))

    def rewrite(part: str) -> str:
        part = re.sub(_EDGE + r"(" + names + r")=(['\"]?)([^'\"\s,;)]*)\2",
                      lambda m: f"{every[m.group(1)]} {m.group(3)}", part)
        part = re.sub(_EDGE + r"(" + names + r")\[(['\"])(\w+)\2\]", lambda m: f'{every[m.group(1)]} "{m.group(3)}"',
                      part)
        part = re.sub(_EDGE + r"(" + "|".join(sorted(_FLAGS, key=len, reverse=True)) + r")" + _END,
                      lambda m: _FLAGS[m.group(1)], part)
        return re.sub(_EDGE + r"(" + "|".join(_WORD_FLAGS) + r")(?= must\b| is not\b| has\b)",
                      lambda m: "--" + m.group(1), part)

    # the text between double quotes is JSON the user writes (keys such as "class_names"): kept
    pieces = re.split(r'("[^"]*")', msg)
    return "".join(p if p.startswith('"') and p.endswith('"') and len(p) > 1 else rewrite(p) for p in pieces)


def main(argv: Optional[List[str]] = None) -> int:
    """The ``mars`` entry point: the exit status (0 done, 1 done with skipped files, 2 error).

    A reader that closes the pipe early (``mars evaluate ... | head -1``) ends the command
    quietly with status 141, what a shell reports for a program killed by SIGPIPE (so that
    ``set -o pipefail`` sees the same as for any other tool). ``--help`` into a closed pipe
    exits 0: argparse itself ignores the failed write.

    Ctrl-C (KeyboardInterrupt, SIGINT) ends any command with one line on stderr and status 130
    (128 + SIGINT, what a shell reports for a program killed by it); every output is written
    atomically, so a run interrupted at any point resumes when it is run again. Worker processes
    (``--workers``) ignore SIGINT: the command stops them (see :func:`mars_plugin.commands.debias.debias_job`).
    A Ctrl-C before this function runs (while torch imports) ends with the same line, status 130
    (:mod:`mars_plugin._interrupt`), whose handler this function replaces by Python's own."""
    try:
        # Inside the try: a Ctrl-C that lands just after the swap of handlers (Python's own
        # raises KeyboardInterrupt) is this function's to report, not a traceback.
        _interrupt.restore()
        try:
            code = _main(argv)
        except SystemExit:  # argparse: --help, --version, usage errors
            sys.stdout.flush()
            raise
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        return _interrupted(argv)
    except BrokenPipeError:
        # Python would flush stdout again at exit and print an error: point it at devnull.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141


#: What an interrupted command leaves (kept with the line's text in :mod:`mars_plugin._interrupt`).
_AFTER_INTERRUPT = _interrupt.AFTER_INTERRUPT


def _interrupted(argv: Optional[List[str]]) -> int:
    """The one line of an interrupted command, and its exit status 130."""
    import signal
    import threading

    # A second Ctrl-C while this line is written must not print a traceback either.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
    try:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        print(_interrupt.interrupt_line(argv), file=sys.stderr, flush=True)
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
    return 130


def _print_skipped(s) -> None:
    """Every file a run skipped, on stderr (the summary line on stdout has the count), and every
    file it read that adds nothing (warnings, which leave the exit status as it is)."""
    lines = s.skipped_lines() if s is not None and hasattr(s, "skipped_lines") else []
    lines += s.warning_lines() if s is not None and hasattr(s, "warning_lines") else []
    if lines:
        print("\n".join(lines), file=sys.stderr)


#: The files and folders each command reads, by flag. An output (``--out``; ``mars evaluate``'s
#: ``--json``) is never one of them, inside one or around one, refused before any is read
#: (:func:`~mars_plugin.commands.inputs.check_out_apart`). The job functions check the inputs
#: they are given too (the Python API); here also those only the command line reads
#: (``--class-names``, ``--model``, the model files, DHR's tree under ``--root``).
_READS = {
    "features": ("--images", "--checkpoint", "--backbone", "--heads"),
    "centroids": ("--features", "--labels", "--image-labels", "--class-names"),
    "debias": ("--features", "--labels", "--centroids", "--images", "--image-labels", "--class-names"),
    "report": ("--labels", "--debiased", "--images", "--class-names"),
    "evaluate": ("--pred", "--gt", "--class-names"),
    "predict": ("--images", "--model"),
    "crf": ("--cams", "--probs", "--images"),
    "train": ("--images", "--labels", "--image-labels", "--class-names", "--weights"),
    "reproduce": ("--pseudo", "--features", "--checkpoint", "--backbone", "--heads"),
    "demo": (),  # demo and sample read no file: their world is generated
    "sample": (),
}


def _check_out_apart(args) -> None:
    """:func:`~mars_plugin.commands.inputs.check_out_apart` on the parsed flags of ``args.command``."""
    from mars_plugin.commands.inputs import check_out_apart, root_reads

    reads = {}
    root = getattr(args, "root", None)
    if root is not None and args.command in ("predict", "train", "reproduce"):
        from mars_plugin.commands.reproduce import default_domain

        data = args.data or "VOC2012"
        domains = [args.domain or default_domain(data, root)]
        if args.command == "reproduce" and args.train:  # then it trains, and scores the validation split
            domains.append(args.val_domain)
            reads["--weights"] = args.weights
        reads["--root"] = root_reads(root, data, domains, references=args.command == "reproduce" and
                                     not args.no_references)
    reads.update({flag: getattr(args, flag[2:].replace("-", "_")) for flag in _READS[args.command]})
    flag = "--json" if args.command == "evaluate" else "--out"
    check_out_apart(getattr(args, flag[2:]), flag, reads)


def _main(argv: Optional[List[str]]) -> int:
    args = build_parser().parse_args(argv)
    from mars_plugin.commands.command_table import command
    from mars_plugin.runs import errors

    apply_threads(args.threads)
    spec = command(args.command)
    res = None  # the command's result; failures skipped with --on-error skip make the exit status 1
    joined = False  # whether this call joined a torchrun process group (and must leave it)
    try:
        _check_out_apart(args)  # before any work: an output is never an input
        if spec.joins is not None:
            joined = _maybe_init_distributed(train=args.device if spec.joins == "device" else None)
        res = spec.run(args)  # under torchrun: this rank's share; a failure on one rank fails all
        if res.after is not None:  # once the summary is held: a failure still lists the skipped files
            res.after()
        if spec.sharded is not None:
            _sharded_lines(spec.sharded, args.command, res)
    except BrokenPipeError:
        raise  # the reader is gone: main() ends quietly
    except errors.JobError as e:
        _print_skipped(res and res.summary)
        print(f"mars {args.command}: error: {errors.one_line(e)}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError) as e:  # PermissionError is an OSError
        _print_skipped(res and res.summary)
        msg = errors.one_line(e)
        print(f"mars {args.command}: error: {msg if isinstance(e, OSError) else _flag_names(msg)}", file=sys.stderr)
        return 2
    finally:
        if joined:
            import torch.distributed as dist

            dist.destroy_process_group()
    return _exit_status(res)


def _sharded_lines(word: str, name: str, res: Any) -> None:
    """The line of a sharded folder job: one for a single process, one per rank under torchrun
    (whose ranks then meet before leaving, :attr:`CommandResult.meet`)."""
    from mars_plugin.runs import distributed

    rank, world = distributed._rank_world()
    if world == 1:
        print(f"{word} -> {res.out}: {res.summary.line()}")
    else:
        print(f"{name} rank {rank}/{world}: {res.summary.line()} -> {res.out}", flush=True)
        res.meet = True


def _exit_status(res: Any) -> int:
    """0 done, 1 done with skipped files (or the command's own status); under torchrun with
    several ranks each names its skipped files, then all leave together."""
    s = res.summary
    if res.meet:
        from mars_plugin.runs import distributed

        _print_skipped(s)
        sys.stdout.flush()
        distributed.barrier()
        return 1 if s.failed else 0
    if res.status is not None:
        return res.status
    _print_skipped(s)
    return 1 if s is not None and s.failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
