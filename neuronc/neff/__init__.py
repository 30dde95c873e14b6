"""NEFF: the executable format. A versioned flatbuffer (`neff.fbs`) with a verifying reader."""
from neuronc.neff.reader import decode, load
from neuronc.neff.writer import encode, save

__all__ = ["decode", "encode", "load", "save"]
