"""The release of tf_adacomp, in a module of its own.

Modules that name the release in their messages (the compressor configs' checks) read it
here: importing the package's ``__init__`` instead, which imports every module, would
make them depend on everything.
"""

__version__ = "0.1.0"
