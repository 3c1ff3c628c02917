"""pipesvc's version (``pipesvc.__version__``), in a module of its own so that any part of the
package can read it without importing the package's public API."""

VERSION = "0.2.0"
