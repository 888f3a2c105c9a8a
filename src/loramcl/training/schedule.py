"""How far a run's learning-rate schedule gets: a warm-up as long as the run or longer never reaches the learning rate
set (issue 61: `--training.warmup_steps 100 --training.steps 3` trained at 2% of it, and nothing said so).

transformers' schedules are ``LambdaLR``s: the factor at scheduler step t sets the rate of optimizer step t + 1, and a
warm-up rises linearly to 1 at t = warmup_steps. The schedule is built here as ``Trainer.create_scheduler`` builds
it (``get_scheduler`` with the arguments' type, warm-up and kwargs; checked on transformers 5), so a schedule without
a warm-up ("constant") or another shape reads as it trains.
"""

from __future__ import annotations


def learning_rate_reached(args, steps: int) -> float:
    """The highest factor of ``args.learning_rate`` (``TrainingArguments``) that the schedule reaches over ``steps``
    optimizer steps: 1.0 unless a warm-up outlasts them (its last step then trains at (steps - 1) / warmup_steps);
    1.0 for a schedule that is no ``LambdaLR`` (reduce_lr_on_plateau), which has no warm-up."""
    import torch
    from transformers import get_scheduler

    warmup = args.get_warmup_steps(steps)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    try:
        scheduler = get_scheduler(args.lr_scheduler_type, optimizer=optimizer, num_warmup_steps=warmup,
                                  num_training_steps=steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    except (ValueError, TypeError, KeyError):  # a schedule this copy cannot build (Trainer's own would have failed
        return 1.0                             # first, or a scheduler of the user's): no warning rather than a crash
    factors = getattr(scheduler, "lr_lambdas", None)
    if not factors or steps < 1:
        return 1.0
    # rising during the warm-up, then at most 1: the peak is at its end or at the run's last step, whichever is first
    return min(1.0, float(factors[0](min(warmup, steps - 1))))


def warmup_shortfall(args, steps: int) -> str | None:
    """None when the schedule of ``args`` reaches its learning rate within ``steps`` optimizer steps; else what it
    reaches, as a sentence: "the learning rate never reaches the 0.01 set: warmup_steps 100 outlasts the run's 3
    steps, whose last trains at 0.0002 (2% of it)"."""
    reached = learning_rate_reached(args, steps)
    if reached >= 1.0:
        return None
    last = f"the run's {steps} steps, whose last trains" if steps > 1 else "the run's only step, which trains"
    return (f"the learning rate never reaches the {args.learning_rate:g} set: warmup_steps "
            f"{args.get_warmup_steps(steps)} outlasts {last} at {reached * args.learning_rate:.3g} "
            f"({100 * reached:.3g}% of it)")


__all__ = ["learning_rate_reached", "warmup_shortfall"]
