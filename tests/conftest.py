import os

import torch

# pytest-xdist runs one worker per core: one intra-op thread each avoids oversubscription,
# which on a 2-core machine makes small CPU kernels orders of magnitude slower.
torch.set_num_threads(1)

# Without a GPU, Triton kernels run in its interpreter. The flag is read when kernels are
# decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
