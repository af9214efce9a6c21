"""SpecDec++: lossless speculative decoding with adaptive candidate lengths.

The core library: the math (sampling, verification, stopping policies, acceptance head), the
model runtimes and the in-process engine. It imports neither Ray nor gRPC.
"""

__version__ = "0.1.0"
