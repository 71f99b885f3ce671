"""imexd: a node-local supervisor for the NVIDIA IMEX daemon.

One agent per GPU node learns its IMEX domain's members over MQTT, writes the IMEX
configuration files, supervises `nvidia-imex` and reports health.
"""

__version__ = "0.1.0"
