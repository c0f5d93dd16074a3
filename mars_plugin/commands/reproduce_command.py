"""``mars reproduce`` on the command line: the parsed flags -> :class:`ReproduceSettings` ->
:func:`~mars_plugin.commands.reproduce.run_reproduce`, its lines on stdout, then ``--train``'s
second step (:func:`~mars_plugin.commands.reproduce_train.train_after_reproduce`)."""
from __future__ import annotations

import argparse
from typing import Any, Dict

from mars_plugin.commands.command_table import CommandResult

__all__ = ["run_reproduce_command"]


def run_reproduce_command(args: argparse.Namespace) -> CommandResult:
    """``mars reproduce``: the run (or ``--dry-run``'s plan: exit 1 on a mismatch), its mIoU line,
    and with ``--train`` the trained network's."""
    from mars_plugin.commands.reproduce import run_reproduce
    from mars_plugin.commands.reproduce_settings import ReproduceSettings

    progress = not args.no_progress
    res = run_reproduce(ReproduceSettings.from_args(args), dry_run=args.dry_run, progress=progress)
    if args.dry_run:
        return CommandResult(status=1 if res["mismatches"] else 0)
    p, d = res["pseudo"], res["debiased"]
    if res["rank"] == 0:
        print(f"mIoU of the labels: pseudo {100 * p['miou']:.1f}, debiased {100 * d['miou']:.1f} "
              f"({p['num_images']} images); details and the paper's figures in {res['report']}")
    if args.train:
        _train(args, res, progress)
    # torchrun stops every rank as soon as one exits non-zero (1: files skipped): each rank names
    # its skipped files, then they leave together.
    return CommandResult(summary=res["summary"], meet=res["world_size"] > 1)


def _train(args: argparse.Namespace, res: Dict[str, Any], progress: bool) -> None:
    """``--train``: mars train on the debiased labels, then predict and score the validation split."""
    from mars_plugin.commands.reproduce_settings import default_domain
    from mars_plugin.commands.reproduce_train import train_after_reproduce

    opts = dict(arch=args.arch, backbone=args.train_backbone, weights=args.weights, iterations=args.iterations,
                batch_size=args.train_batch_size, crop=args.crop, min_size=args.min_size, max_size=args.max_size,
                lr=args.lr, seed=args.seed, workers=args.loader_workers)
    t = train_after_reproduce(args.root, args.out, data=args.data,
                              domain=args.domain or default_domain(args.data, args.root), val_domain=args.val_domain,
                              train_options=opts, device=args.device, masks=not args.no_masks, progress=progress)
    if res["rank"] == 0 and t["val"] is not None:
        print(f"mIoU of the trained network on {args.val_domain}: {100 * t['val']['miou']:.1f} ({t['checkpoint']})")
