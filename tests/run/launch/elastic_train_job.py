"""``run_training`` on a tiny GPT, for the tests: ``elastic_train_job.py OUT STRATEGY
ZERO_STAGE STEPS [async]`` (strategy "elastic" or a fixed one). With ``async`` a checkpoint
is written asynchronously after every step, and the write of the first one takes a second
more (the writer hook), so that a resize at the first step boundary finds it in flight."""

import sys

from mpidist.run import TrainConfig, run_training

out, strategy, stage, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
asynchronous = sys.argv[5:] == ["async"]
if asynchronous:
    import os

    os.environ["MPIDIST_CHECKPOINT_WRITER_HOOK"] = "point=mid-write,action=delay,seconds=1,step=1"
cfg = TrainConfig(out=out, strategy=strategy, zero_stage=stage, n_layer=1, n_head=2, n_embd=16,
                  vocab_size=256,  # as stored: a joiner that finds a checkpoint compares
                  block_size=16, global_batch=12, dtype="float64", eval_interval=0,
                  eval_batches=1, steps=steps, checkpoint_interval=1 if asynchronous else 2,
                  progress=False, resume="auto", checkpoint_async=asynchronous)
run_training(cfg)
