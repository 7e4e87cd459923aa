# Does SO_RCVLOWAT gate poll readiness on AF_UNIX stream sockets (and TCP), kernel here?
import select, socket
for fam in ("unix", "tcp"):
    if fam == "unix":
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(); a = socket.create_connection(ls.getsockname()); b, _ = ls.accept()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1000)
    a.send(b"x" * 10)
    import time; time.sleep(0.05)
    p = select.epoll(); p.register(b.fileno(), select.EPOLLIN)
    print(fam, "lowat", b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT), "10 bytes queued -> readable:", bool(p.poll(0.1)))
