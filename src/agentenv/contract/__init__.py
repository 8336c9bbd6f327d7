"""The one contract between the control plane and the nodes that run sandboxes.

`runtime` is what the control plane asks of a node (the `Runtime` protocol and the values that
cross it); `errors` are the typed failures either side raises, each with its HTTP status. Both
halves import this package; neither imports the other.
"""
