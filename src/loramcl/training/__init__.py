"""Training: ``config`` (``DataConfig``, ``TrainConfig``), ``trainer`` (``MCLTrainer``, transformers' Trainer with the
MCL loss), ``checkpoints`` (whole-or-absent checkpoints, resume), ``runs`` (a run's settings and records), ``fit``
(a run from its settings: `loramcl train`, and the training stage every recipe runs) and ``reference_nll``
(`loramcl nll`: every reference's NLL under every hypothesis of a trained run)."""
