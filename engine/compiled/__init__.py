"""The compiled decode step: batch buckets, one torch.compile graph per bucket (CPU: inductor's
C++ backend; CUDA: captured as CUDA graphs), the compile cache and start-up compilation."""
