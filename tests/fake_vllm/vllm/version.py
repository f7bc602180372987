__version__ = "0.32.0"
__version_tuple__ = (0, 32, 0)
