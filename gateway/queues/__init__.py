"""Where waiting requests are held: the RequestQueue protocol and its stores."""
