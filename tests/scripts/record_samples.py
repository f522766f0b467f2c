"""`python -m mega_depth.train` that also appends every training-sample index it reads to $RECORD_SAMPLES.rank<R>.

For the resume tests: the union of what the runs of one training read must be each sample exactly once.
"""

import os
import sys

from mega_depth.training import trainer

_samplers = trainer.Trainer._samplers


class Recording:
    """The training dataset, recording each index asked for."""

    def __init__(self, dataset, path):
        self.dataset, self.path = dataset, path

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        with open(self.path, "a") as f:
            f.write(f"{index}\n")
        return self.dataset[index]


def samplers(self, *args, **kwargs):
    train, valid = _samplers(self, *args, **kwargs)
    train.dataset = Recording(train.dataset, f"{os.environ['RECORD_SAMPLES']}.rank{self.backend.rank}")
    return train, valid


trainer.Trainer._samplers = samplers

if __name__ == "__main__":
    from mega_depth.train import main

    sys.exit(main(sys.argv[1:]))
