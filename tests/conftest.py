import torch

# pytest-xdist runs one worker per core: one intra-op thread each avoids oversubscription,
# which on a 2-core machine makes small CPU kernels orders of magnitude slower.
torch.set_num_threads(1)
