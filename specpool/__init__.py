"""specpool: disaggregated speculative decoding."""

from pkgutil import extend_path

# `make setup` installs the project editable in setuptools' strict mode: the tiers are linked in as
# build/__editable__.*/specpool/engine, .../router, ... Run from the repository's root, this folder
# (holding only cli.py and common/) comes first on sys.path, so the package's path takes in the linked
# one too. Installed any other way there is no second folder: it stays this one.
__path__ = extend_path(__path__, __name__)

from specpool.engine.runtime import process_env  # found through the path above

process_env.apply()  # before anything imports torch: libgomp and oneDNN read these when it loads
