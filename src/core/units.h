// Byte sizes and bandwidths as people write them on a command line, and back.
//
// Decimal units are powers of 1000 (KB = 1e3, MB = 1e6, GB = 1e9, TB = 1e12, PB = 1e15), binary
// units powers of 1024 (KiB, MiB, GiB, TiB, PiB), as in IEC 80000-13. Units are case-insensitive
// ("80gb" = "80GB"); a space may separate the number from the unit.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kestrel {

// "80GB" -> 80000000000, "64GiB" -> 68719476736, "1500000000" (plain bytes), "1.5GB", "2e9".
// A fractional byte count is rounded down. Throws kestrel::Error("<what>: ...") naming the text
// when it is not a number with an optional unit, or is not >= 1 byte, or does not fit in int64.
int64_t parse_byte_size(std::string_view text, std::string_view what);

// Bytes per second: "4.8TB/s" -> 4.8e12, "3.35e12" (plain bytes/s), "900GB/s", "2TiB/s"; the
// "/s" is optional. Throws kestrel::Error("<what>: ...") naming the text when it is not a
// positive, finite number with an optional unit.
double parse_bandwidth(std::string_view text, std::string_view what);

// 1536 -> "1.50 KiB", 188743680 -> "180.00 MiB"; below 1 KiB, "512 B".
std::string format_bytes_binary(double bytes);
// 4.8e12 -> "4.80 TB/s" (decimal units, as bandwidths are quoted).
std::string format_bandwidth(double bytes_per_s);
// 327680 -> "327,680".
std::string format_thousands(int64_t n);

}  // namespace kestrel
