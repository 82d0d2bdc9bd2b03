// Tells whether the client of an HTTP request has gone away while its handler waits for tokens.
//
// cpp-httplib does not hand handlers the connection's socket, and it notices a closed connection
// only when a write fails, so a client that disconnects while its request waits in the engine's
// queue (or during a non-streamed generation) would keep its KV blocks until the end. The probe
// finds the socket among the process's descriptors by its two addresses (unique among open
// sockets; it stays open while the handler runs on its thread) and peeks at it: a read of 0 bytes
// means the peer closed its end.
#pragma once

#include <string>

namespace httplib {
struct Request;
}

namespace kestrel::cli {

class ConnectionProbe {
 public:
  explicit ConnectionProbe(const httplib::Request& req);
  // True once the peer has closed the connection or it broke. The socket is looked up on the first
  // call (one pass over /proc/self/fd); if it cannot be found, the answer is always false.
  bool closed();

 private:
  int find_socket() const;

  std::string remote_addr_;
  int remote_port_;
  int local_port_;
  int fd_ = -2;  // -2: not looked up yet, -1: not found
};

}  // namespace kestrel::cli
