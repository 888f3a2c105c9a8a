"""Mixtures of Markov chains: the paper's synthetic setting (§3.3, App. C-D), its theory and its experiment.

``chains`` defines and samples mixtures, ``theory`` computes what an optimal LoRA-MLE / LoRA-MCL model reaches,
``experiment`` trains the paper's toy model through MCLTrainer, ``report`` writes the figure and reports,
``reproduce.markov`` is the ``loramcl markov`` command, and ``compare`` trains the four systems of the baselines
(LoRA-MCL, LoRA-MLE, LoRA-MoE, multi-head MCL) on the mixture (``python -m loramcl.recipes.markov.compare``).
"""
