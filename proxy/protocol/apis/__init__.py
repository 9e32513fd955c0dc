"""One codec per API shape (see `proxy.protocol.codec`); `proxy.protocol.codecs` finds them."""
