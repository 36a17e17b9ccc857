"""Objects a hostile recipe might try to reach through an allowed prefix (``tests.``): each is
public by name but defined elsewhere, bound to an object, or reached through an instance."""

import collections
import logging
import os
import subprocess  # noqa: F401  (a re-exported stdlib module)

from torch import Tensor  # noqa: F401  (a class re-exported from torch)

system = os.system                  # a builtin defined in posix/nt
REGISTRY: dict = {}
put = REGISTRY.__setitem__          # bound builtin methods: no __module__
get = REGISTRY.get
join = " ".join
logger = logging.getLogger("payload")  # an instance: logger.info is logging's
OrderedDict = collections.OrderedDict   # a stdlib class re-exported


class Holder:
    run = staticmethod(os.system)    # a stdlib function as a class attribute
    env = os.environ                 # an instance on the way

    @classmethod
    def make(cls, value=0):          # a legitimate classmethod of an allowed class
        return value


def build(value=0):
    """A legitimate target."""
    return value
