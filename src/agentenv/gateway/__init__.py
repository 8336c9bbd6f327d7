"""A node's data gateway: how a control-plane replica on another host reaches the guests.

Guests listen at slot addresses that only their own host routes to (and that two hosts may
both use). Each node agent therefore runs a small HTTP CONNECT server (`server`): a replica
asks it for a tunnel to ``<sandbox id>:<port>``, with the cluster's node token, and the node
joins the tunnel to that sandbox's slot address if the sandbox runs there. The proxy's HTTP
pools and WebSocket connections are opened through such tunnels (`client`). Everything in the
tunnel is the proxy's own traffic, unchanged (plain HTTP, WebSocket, or a guest's TLS).
"""
