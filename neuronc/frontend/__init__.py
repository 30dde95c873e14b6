"""Frontend: the only layer that knows PyTorch graph formats and MLIR.

FX GraphModules (torch.compile) and ExportedPrograms (.pt2) go through torch-mlir to StableHLO,
and StableHLO comes into the neuronc graph IR.
"""
