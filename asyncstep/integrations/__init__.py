"""asyncstep run by other systems: each sub-package is one integration
(:mod:`~asyncstep.integrations.ray`: Ray). An integration is the top layer:
it may import the package's face, the server and anything below it; nothing
in asyncstep imports it, and importing this package imports nothing."""
