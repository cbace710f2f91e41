"""The application shell: the `adapt` command line and `adapt doctor` over the library packages."""

__version__ = "0.1.0"
