"""Training and inference: `wsitrain fit` and `wsitrain predict` through the SFT engine.

Modules: fit (run_fit: the epochs, checkpoints, resume), predict (run_predict), loop (Trainer: one slide forward/
backward, one optimizer step, one evaluation), data (labels, split, read settings, epoch order), engine (device,
seeds, model + SFT wrapper), optim (optimizers, schedules, losses), metrics, runfolder, checkpoint (atomic save/load),
recorder (metrics.jsonl, tiles.jsonl, plans), progress (live display, summary table), distributed (torchrun helpers).
"""
