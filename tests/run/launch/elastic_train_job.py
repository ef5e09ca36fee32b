"""``run_training`` on a tiny GPT, for the tests: ``elastic_train_job.py OUT STRATEGY
ZERO_STAGE STEPS`` (strategy "elastic" or a fixed one)."""

import sys

from mpidist.run import TrainConfig, run_training

out, strategy, stage, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg = TrainConfig(out=out, strategy=strategy, zero_stage=stage, n_layer=1, n_head=2, n_embd=16,
                  block_size=16, global_batch=12, dtype="float64", eval_interval=0,
                  eval_batches=1, steps=steps, checkpoint_interval=2, progress=False,
                  resume="auto")
run_training(cfg)
