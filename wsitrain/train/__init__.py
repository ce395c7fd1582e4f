"""Training and inference: `wsitrain fit` and `wsitrain predict` through the SFT engine.

Modules: fit (run_fit: the command), recipe (FitRecipe: setup / train / validate / save, callbacks), state (FitState:
counters a checkpoint keeps), predict (run_predict), loop (Evaluator and Trainer: one slide forward/backward, one
optimizer step, one evaluation, each with its peak memory), data (labels, split, read settings, epoch order),
engine (device, seeds, model + SFT wrapper), optim (optimizers, schedules, losses), metrics, plateau (near-constant
outputs flagged), runfolder (run folders,
resume, JSON-lines logs), checkpoint (atomic save; load as data through wsitrain.safe_load; a failed write through
wsitrain.write_errors), recorder (metrics.jsonl, tiles.jsonl, plans), progress
(live display, summary table), distributed (torchrun helpers), preempt (stop signals, --resume auto), balance/
(which slides each rank trains per step, and how long ranks wait).
"""
