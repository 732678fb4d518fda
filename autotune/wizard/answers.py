"""Non-interactive answers: the value flags as the wizard's overrides, checked before any question.

Every question's flag is read where the question is asked (``Asker``); what is here are the plan values
(batch, accumulation, rank, resolution, epochs, optimizer, precision, checkpointing, text encoder), which
are applied together to the plan and re-predicted like a change typed at the plan table, and the checks
that look at several flags at once.
"""

from __future__ import annotations

import argparse

from autotune.wizard.overrides import Overrides
from sd_scripts_compat.facts.errors import UserError

# flag -> Overrides field
VALUE_FLAGS = {"batch_size": "train_batch_size", "grad_accum": "gradient_accumulation_steps", "rank": "network_dim",
               "resolution": "resolution", "epochs": "max_train_epochs", "optimizer": "optimizer_type",
               "precision": "mixed_precision", "gradient_checkpointing": "gradient_checkpointing",
               "train_text_encoder": "train_text_encoder"}


def check_flags(args: argparse.Namespace) -> None:
    """Contradictions between flags, as one line each, before the first question."""
    if args.gpu and args.gpu_index is not None:
        raise UserError("--gpu NAME plans for a catalogue card and --gpu-index picks a probed one; give one of them")
    if args.cpu and (args.gpu or args.gpu_index is not None):
        raise UserError("--cpu plans for this machine's CPU; drop --gpu / --gpu-index, or drop --cpu")
    if args.organise == "no" and (args.repeats or args.trigger or args.organise_into):
        raise UserError("--organise no keeps the flat folder; --repeats / --trigger / --organise-into need "
                        "--organise link or --organise copy")
    for name, flag in (("batch_size", "--batch"), ("grad_accum", "--accum"), ("rank", "--rank"),
                       ("epochs", "--epochs"), ("repeats", "--repeats")):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"{flag} {value}: must be 1 or more")


def overrides_from_args(args: argparse.Namespace, family_tiny: bool, on_gpu: bool) -> Overrides:
    """The value flags as overrides; each value passes the rule a typed value passes."""
    from autotune.wizard.review import knob_problem

    values = {field: getattr(args, flag) for flag, field in VALUE_FLAGS.items() if getattr(args, flag) is not None}
    for flag, field in VALUE_FLAGS.items():
        if field in values:
            problem = knob_problem(field, values[field], family_tiny, on_gpu)
            if problem:
                raise UserError(f"--{flag.replace('_', '-')} {values[field]}: {problem}")
    return Overrides(**values)
