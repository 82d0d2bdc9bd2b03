#include "server/connection_probe.h"

#include <httplib.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdlib>

namespace kestrel::cli {

namespace {
// The numeric address and the port of a socket address; false for other families.
bool address_of(const sockaddr_storage& a, std::string* addr, int* port) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(a);
    if (inet_ntop(AF_INET, &in.sin_addr, buf, sizeof buf) == nullptr) return false;
    *port = ntohs(in.sin_port);
  } else if (a.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(a);
    if (inet_ntop(AF_INET6, &in6.sin6_addr, buf, sizeof buf) == nullptr) return false;
    *port = ntohs(in6.sin6_port);
  } else {
    return false;
  }
  *addr = buf;
  return true;
}
}  // namespace

ConnectionProbe::ConnectionProbe(const httplib::Request& req)
    : remote_addr_(req.remote_addr), remote_port_(req.remote_port), local_port_(req.local_port) {}

int ConnectionProbe::find_socket() const {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (const dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0') continue;
    sockaddr_storage peer{}, local{};
    socklen_t len = sizeof peer;
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &len) != 0) continue;
    std::string addr;
    int port = 0;
    if (!address_of(peer, &addr, &port) || port != remote_port_ || addr != remote_addr_) continue;
    len = sizeof local;
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &len) != 0) continue;
    if (!address_of(local, &addr, &port) || port != local_port_) continue;
    found = static_cast<int>(fd);
    break;
  }
  closedir(dir);
  return found;
}

bool ConnectionProbe::closed() {
  if (fd_ == -2) fd_ = find_socket();
  if (fd_ < 0) return false;
  char c;
  const ssize_t n = recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n == 0) return true;
  return n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

}  // namespace kestrel::cli
