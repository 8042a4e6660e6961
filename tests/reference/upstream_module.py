"""Loads one upstream source file as a named module, without its package's __init__ (the
reference scripts stub the package imports they do not need)."""

import importlib.util
import sys


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return m
