import torch

# Tests run two pytest workers on a 2-core machine; one intra-op thread per worker keeps them from spinning
# against each other (the CPU backend's concurrency comes from its lane threads, not from intra-op threads).
torch.set_num_threads(1)
