"""The package version, in a module of its own: ``api`` (which records it in every manifest) and
the package ``__init__`` both import it from here, and the build reads it from here."""

__version__ = "0.1.0"
