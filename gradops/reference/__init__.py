"""Readable PyTorch implementations of every operator: exact formulas, any device, any
float dtype (half precision accumulates in float32, float64 stays float64). They are the
oracle the kernels are tested against and the CPU path of the library."""
