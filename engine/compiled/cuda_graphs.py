"""placeholder until the CUDA path lands"""
