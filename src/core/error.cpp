#include "core/error.h"

namespace kestrel {

void assert_fail(const char* expr, const char* file, int line, const std::string& msg) {
  throw Error(std::string("internal error: ") + msg + " (" + expr + " failed at " + file + ":" +
              std::to_string(line) + ")");
}

}  // namespace kestrel
