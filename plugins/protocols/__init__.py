"""HTTP protocol adapters: each translates one wire API to engine requests and back."""
