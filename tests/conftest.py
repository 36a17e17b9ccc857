"""Suite-wide settings: one intra-op thread. The tests use tiny shapes, for which a second
thread only adds synchronisation (measured up to 10x slower on a loaded 2-core machine), and
multi-process tests run one thread per rank anyway."""

import torch

torch.set_num_threads(1)
